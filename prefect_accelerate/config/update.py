"""`config update`: migrate a config file to the current format, saying what changed (reference §2.3).

Accelerate's update rewrites the file in place (and crashes with a TypeError when there is no file at
all, §13.11). Here the rewrite is atomic, the original is kept as `<file>.bak` whenever the content
changes, the changes are listed, and a missing file is an error that says where we looked.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from prefect_accelerate.config.io import check_regular_file, config_text, migrate, parse_config, read_raw, write_text_atomic
from prefect_accelerate.config.model import AnyConfig
from prefect_accelerate.config.paths import ConfigLocation, find_default_config, searched_locations
from prefect_accelerate.errors import ConfigError


class UpdateResult(BaseModel):
    """What `config update` did: the file, the migrated config and the list of changes."""

    model_config = ConfigDict(frozen=True)

    location: ConfigLocation
    config: AnyConfig
    changes: list[str] = Field(default_factory=list)
    written: bool = False
    backup: Path | None = None

    @property
    def path(self) -> Path:
        return self.location.path

    def message(self) -> str:
        if not self.written:
            return f"The configuration file at {self.path} is already up to date; nothing changed."
        lines = [f"Successfully updated the configuration file at {self.path}."]
        lines += [f"  - {change}" for change in self.changes]
        if self.backup is not None:
            lines.append(f"The previous content is kept in {self.backup}.")
        return "\n".join(lines)


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


def describe_changes(before: dict[str, Any], after: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """Readable differences between the file as read and as written, as (top-level key, text) pairs."""
    changes: list[tuple[str, str]] = []
    for key in sorted(set(before) | set(after)):
        name = f"{prefix}{key}"
        top = prefix.split(".")[0] if prefix else key
        if key not in after:
            old = before[key]
            reason = " (it was null)" if old is None else " (it was empty)" if old == {} else ""
            changes.append((top, f"dropped {name}{reason}"))
        elif key not in before:
            changes.append((top, f"added {name}: {_show(after[key])}"))
        elif isinstance(before[key], dict) and isinstance(after[key], dict):
            changes.extend(describe_changes(before[key], after[key], prefix=f"{name}."))
        elif before[key] != after[key] or type(before[key]) is not type(after[key]):
            changes.append((top, f"{name}: {_show(before[key])} -> {_show(after[key])}"))
    return changes


def resolve_existing(config_file: str | os.PathLike[str] | None) -> ConfigLocation:
    """The file a command works on: the one passed (it must exist), else the default one."""
    if config_file is not None:
        path = Path(config_file).expanduser()
        if path.exists() or path.is_symlink():
            check_regular_file(path)  # a FIFO, a device or a folder: say what it is
        if not path.is_file():
            raise ConfigError(
                f"The config file {path} does not exist. Check the --config_file path; to create a config there, "
                f"run `prefect-accelerate config --config_file {path}` or `prefect-accelerate config default "
                f"--config_file {path}`."
            )
        return ConfigLocation(path, "passed")
    location = find_default_config()
    if location is None:
        looked = " and ".join(str(p) for p in searched_locations())
        raise ConfigError(
            f"There is no config file to update: no --config_file was given and no default config exists (looked "
            f"for {looked}). Pass --config_file, or create a default with `prefect-accelerate config default`."
        )
    return location


def update_config_file(config_file: str | os.PathLike[str] | None = None) -> UpdateResult:
    """Migrate `config_file` (or the default config) in place; a second run changes nothing.

    Raises:
        ConfigError: no such file, or the file cannot be read or validated. The file is then untouched.
    """
    location = resolve_existing(config_file)
    raw = read_raw(location.path)
    data, migration = migrate(raw, location.path, drop_removed=True)
    config = parse_config(data, location.path)
    text = config_text(config, location.path)
    if location.path.read_text(encoding="utf-8") == text:
        return UpdateResult(location=location, config=config)
    changes = list(migration.changes)
    for key, change in describe_changes(raw, config.to_dict()):
        if key not in migration.touched:
            changes.append(change)
    if not changes:
        changes.append("rewrote the file in the canonical layout (keys sorted)")
    backup = write_text_atomic(location.path, text, backup=True)
    return UpdateResult(location=location, config=config, changes=changes, written=True, backup=backup)
