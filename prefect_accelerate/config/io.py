"""Reading, migrating, validating and writing Accelerate config files.

Reading follows Accelerate (reference §3.2-3.3): the extension picks JSON or YAML, the same legacy
migrations run, and the compute environment picks the class. Two deliberate differences: YAML's
unquoted `NO` stays the text "NO" (YAML 1.2 booleans only), and every problem is a ConfigError whose
one paragraph names the file, the field, the bad value and the fix. Writing is atomic (a temp file in
the same folder, fsync, rename) and keeps the previous content as `<file>.bak`.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError

from prefect_accelerate.config.model import (
    AnyConfig,
    ClusterConfig,
    SageMakerConfig,
    config_class_for,
)
from prefect_accelerate.config.paths import ConfigLocation, find_default_config, searched_locations
from prefect_accelerate.errors import ConfigError, describe_value, did_you_mean

#: Keys Accelerate once wrote and no longer reads: why, and what `config update` does about them.
REMOVED_KEYS: dict[str, str] = {
    "ipex_config": "Accelerate removed its IPEX integration in 1.13, and no launcher reads this section any more",
}


class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans: only true/false are booleans, so `NO` stays the text "NO"."""


_Yaml12Loader.yaml_implicit_resolvers = {
    key: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.copy().items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def is_json_path(path: str | os.PathLike[str]) -> bool:
    return str(path).lower().endswith(".json")


# ---------------------------------------------------------------------------------------------------
# Reading


#: the largest config file read: a config is a few kilobytes; anything near this is not one (and parsing
#: megabytes of YAML takes minutes)
MAX_CONFIG_BYTES = 1024 * 1024
#: at most this many items are listed in one error paragraph
MAX_LISTED = 10


def _kind_of_path(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def check_regular_file(path: Path, what: str = "config file") -> os.stat_result:
    """The stat of `path` if it is a regular file of a sane size; else a ConfigError naming what it is.

    Only regular files are opened: a FIFO would block the read forever and a link to /dev/zero would
    fill memory.
    """
    try:
        info = path.stat()  # follows links: a link to a regular file is fine
    except FileNotFoundError:
        hint = " (it is a link whose target is missing)" if path.is_symlink() else ""
        raise ConfigError(
            f"The {what} {path} does not exist{hint}. Check the path given to --config_file, or create one "
            f"with `prefect-accelerate config` (questions) or `prefect-accelerate config default`."
        ) from None
    except OSError as error:
        raise ConfigError(f"The {what} {path} could not be read ({error.strerror}). Check the path and its permissions.") from None
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"The config path {path} is a folder, not a file. Pass the path of the YAML or JSON config file itself.")
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(
            f"The {what} {path} is {_kind_of_path(info.st_mode)}, not a regular file, so it is not read. Pass the path "
            f"of the YAML or JSON config file itself."
        )
    if info.st_size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"The {what} {path} is {info.st_size:,} bytes; a config is a few kilobytes, and files over "
            f"{MAX_CONFIG_BYTES:,} bytes are not read. Check that the path names the config and not another file."
        )
    return info


def listed(items: list[str], limit: int = MAX_LISTED) -> str:
    """`a`, `b`, ... and N more: a list short enough for one readable paragraph."""
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit:,} more" if len(items) > limit else "")


def read_raw(path: Path) -> dict[str, Any]:
    """The file's top-level mapping, parsed by extension. Raises ConfigError for anything unreadable."""
    kind = "JSON" if is_json_path(path) else "YAML"
    check_regular_file(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(
            f"The config file {path} does not exist. Check the path given to --config_file, or create one "
            f"with `prefect-accelerate config` (questions) or `prefect-accelerate config default`."
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"The config path {path} is a folder, not a file. Pass the path of the YAML or JSON config file itself.") from None
    except OSError as error:
        raise ConfigError(f"The config file {path} could not be read ({error.strerror}). Check its permissions and try again.") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"The config file {path} grew past {MAX_CONFIG_BYTES:,} bytes while it was read; a config is a few kilobytes. Check the path.")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"The config file {path} is not UTF-8 text (byte {error.start} cannot be decoded); it may be a "
            f"binary file. Pass the path of the {kind} config file, or re-create it with `prefect-accelerate config`."
        ) from None
    try:
        raw = json.loads(text) if kind == "JSON" else yaml.load(text, Loader=_Yaml12Loader)  # noqa: S506 - a SafeLoader subclass
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"The config file {path} is not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}. "
            f"Fix the JSON there, or rename the file to .yaml if it holds YAML."
        ) from None
    except yaml.YAMLError as error:
        where = ""
        mark = getattr(error, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(
            f"The config file {path} is not valid YAML: {problem}{where}. Fix the YAML there (indentation and "
            f"`key: value` pairs), or re-create the file with `prefect-accelerate config`."
        ) from None
    except (ValueError, RecursionError) as error:  # e.g. numbers too large for the parser
        raise ConfigError(f"The config file {path} could not be parsed as {kind}: {error}. Fix the file, or re-create it with `prefect-accelerate config`.") from None
    if raw is None:
        raise ConfigError(
            f"The config file {path} is empty. Write a config into it with `prefect-accelerate config "
            f"--config_file {path}` or `prefect-accelerate config default --config_file {path} --force`."
        )
    if not isinstance(raw, dict):
        raise ConfigError(
            f"The config file {path} holds a {type(raw).__name__} at the top level, but an Accelerate config is "
            f"a mapping of keys to values (`distributed_type: NO` and so on). Fix the file, or re-create it "
            f"with `prefect-accelerate config`."
        )
    bad_keys = [k for k in raw if not isinstance(k, str)]
    if bad_keys:
        raise ConfigError(
            f"The config file {path} has a key that is not text: {describe_value(bad_keys[0])}. Keys are field names such as "
            f"`distributed_type`; quote or rename it."
        )
    return raw


class Migration(BaseModel):
    """What loading did to an older file so that it matches the current format."""

    changes: list[str] = Field(default_factory=list)
    #: top-level keys a migration step added, removed or rewrote
    touched: set[str] = Field(default_factory=set)

    #: the changes that replaced keys of an older format (not just defaults filled in)
    legacy_changes: list[str] = Field(default_factory=list)

    def note(self, text: str, *keys: str, legacy: bool = False) -> None:
        self.changes.append(text)
        self.touched.update(keys)
        if legacy:
            self.legacy_changes.append(text)


def migrate(raw: dict[str, Any], path: Path, *, drop_removed: bool = False) -> tuple[dict[str, Any], Migration]:
    """Accelerate's `process_config` migrations (reference §3.3), on a copy; returns it and the changes."""
    data = dict(raw)
    migration = Migration()
    if "compute_environment" not in data:
        data["compute_environment"] = "LOCAL_MACHINE"
        migration.note("added compute_environment: LOCAL_MACHINE", "compute_environment")
    if "distributed_type" not in data or data["distributed_type"] is None:
        raise ConfigError(
            f"The config file {path} has no `distributed_type`, which every config needs. Add a line such as "
            f"`distributed_type: NO` (one process), MULTI_GPU, MULTI_CPU, FSDP or DEEPSPEED, or re-create the file "
            f"with `prefect-accelerate config`."
        )
    is_cluster = config_class_for(data) is ClusterConfig
    if is_cluster and "num_processes" not in data and str(data["distributed_type"]).upper() == "NO":
        data["num_processes"] = 1
        migration.note("added num_processes: 1 (distributed_type NO runs one process)", "num_processes")
    if "mixed_precision" not in data:
        legacy = data.get("fp16")
        data["mixed_precision"] = "fp16" if legacy else None
        if legacy:
            migration.note("fp16: true became mixed_precision: fp16", "mixed_precision", legacy=True)
    if "fp16" in data:
        del data["fp16"]
        migration.note("removed the legacy key fp16 (replaced by mixed_precision)", "fp16", legacy=True)
    if "dynamo_backend" in data:
        backend = data.pop("dynamo_backend")
        if str(backend).upper() == "NO":
            data["dynamo_config"] = {}
            migration.note("dynamo_backend: NO became an empty dynamo_config", "dynamo_backend", "dynamo_config", legacy=True)
        else:
            data["dynamo_config"] = {"dynamo_backend": backend}
            migration.note(f"dynamo_backend: {backend} became dynamo_config.dynamo_backend", "dynamo_backend", "dynamo_config", legacy=True)
    for name in ("use_cpu", "debug", "enable_cpu_affinity"):
        if name not in data:
            data[name] = False
    if drop_removed:
        for name, why in REMOVED_KEYS.items():
            if name in data:
                del data[name]
                migration.note(f"removed {name} ({why})", name, legacy=True)
    return data, migration


def _field_path(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p.startswith("function-")))]
    return ".".join(parts)


def _lookup(raw: dict[str, Any], loc: tuple[Any, ...]) -> tuple[bool, Any]:
    node: Any = raw
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            return False, None
    return True, node


def _validation_message(error: ValidationError, raw: dict[str, Any], path: Path) -> str:
    problems: list[str] = []
    for item in error.errors():
        loc = tuple(item.get("loc", ()))
        name = _field_path(loc) or "(top level)"
        message = str(item.get("msg", "invalid value"))
        message = message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
        found, value = _lookup(raw, tuple(p for p in loc if not (isinstance(p, str) and "[" in p)))
        if item.get("type") == "missing":
            problems.append(f"`{name}` is required but missing")
        elif found and not isinstance(value, dict):
            problems.append(f"`{name}` is {describe_value(value)}: {message}")
        else:
            problems.append(f"`{name}`: {message}")
    count = len(problems)
    head = f"The config file {path} has {'a problem' if count == 1 else f'{count:,} problems'}: "
    shown = "; ".join(problems[:MAX_LISTED]) + (f"; and {count - MAX_LISTED:,} more" if count > MAX_LISTED else "")
    return (
        head + shown + ". Edit the file to fix "
        + ("it" if count == 1 else "them")
        + " (or re-create it with `prefect-accelerate config`), then run the command again."
    )


def parse_config(data: dict[str, Any], path: Path) -> AnyConfig:
    """Validate migrated data into the typed model. Raises ConfigError naming every bad field."""
    cls = config_class_for(data)
    unknown = [k for k in data if k not in cls.model_fields]
    if unknown:
        removed = [k for k in unknown if k in REMOVED_KEYS]
        if removed:
            name = removed[0]
            raise ConfigError(
                f"The config file {path} has the key `{name}`, which is no longer part of the format: "
                f"{REMOVED_KEYS[name]}. Run `prefect-accelerate config update --config_file {path}` to remove it "
                f"(the original is kept as {path}.bak), or delete the key by hand."
            )
        hints = " ".join(
            f"For `{_short(k)}`:{did_you_mean(k, cls.model_fields)}" for k in unknown[:MAX_LISTED] if did_you_mean(k, cls.model_fields)
        )
        kind = "a SageMaker" if cls is SageMakerConfig else "a cluster"
        raise ConfigError(
            f"The config file {path} has unknown key{'s' if len(unknown) > 1 else ''} "
            f"{listed([f'`{_short(k)}`' for k in sorted(unknown)])} for {kind} config. {hints + ' ' if hints else ''}"
            f"Remove or rename {'them' if len(unknown) > 1 else 'it'}; the known keys are: {', '.join(sorted(cls.model_fields))}."
        )
    try:
        return cls.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_validation_message(error, data, path)) from None


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class LoadedConfig(BaseModel):
    """A validated config, where it came from and what migration changed."""

    config: AnyConfig
    location: ConfigLocation
    migration: Migration
    raw: dict[str, Any]

    @property
    def path(self) -> Path:
        return self.location.path


def load_config_path(path: str | os.PathLike[str], *, source: str = "passed", drop_removed: bool = False) -> LoadedConfig:
    """Read, migrate and validate one config file."""
    file = Path(path).expanduser()
    raw = read_raw(file)
    remove_stale_temp_files(file)
    data, migration = migrate(raw, file, drop_removed=drop_removed)
    return LoadedConfig(
        config=parse_config(data, file), location=ConfigLocation(file, source), migration=migration, raw=raw  # type: ignore[arg-type]
    )


def load_config_file(config_file: str | os.PathLike[str] | None = None, *, required: bool = True) -> LoadedConfig | None:
    """Load `config_file`, or the default config when it is None.

    Args:
        config_file: an explicit path (must exist), or None for the default location.
        required: when no path was given and no default exists, raise (True) or return None (False).

    Raises:
        ConfigError: the file is missing, unreadable or invalid; the message says which and how to fix it.
    """
    if config_file is not None:
        return load_config_path(config_file)
    location = find_default_config()
    if location is None:
        if not required:
            return None
        looked = " and ".join(str(p) for p in searched_locations())
        raise ConfigError(
            f"No config file was given and there is no default config: looked for {looked} (the folder comes "
            f"from HF_HOME, else XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface). Pass --config_file, or "
            f"create the default with `prefect-accelerate config default` or `prefect-accelerate config`."
        )
    return load_config_path(location.path, source=location.source)


# ---------------------------------------------------------------------------------------------------
# Writing


def config_text(config: AnyConfig | dict[str, Any], path: str | os.PathLike[str]) -> str:
    """The file content for `config` at `path`: JSON for .json, YAML otherwise (keys sorted, as Accelerate)."""
    data = config.to_dict() if not isinstance(config, dict) else config
    if is_json_path(path):
        return json.dumps(data, indent=2, sort_keys=True) + "\n"
    return yaml.safe_dump(data, sort_keys=True)


def write_text_atomic(path: Path, text: str, *, backup: bool = True) -> Path | None:
    """Replace `path` with `text` so that a crash leaves the old or the new content, never a mix.

    When the file exists and its content changes, the old content is first written (atomically too)
    to `<path>.bak`. A link is written through: its target gets the new content (and the `.bak` beside
    it), the link stays a link. An existing file keeps its mode; a new one follows the umask. Temp files
    that a killed writer left beside the file are removed. Returns the backup path, or None.

    Raises:
        ConfigError: the folder cannot be created or written, or the path is not a regular file.
    """
    path = Path(os.path.realpath(Path(path)))  # write through links to the real file
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(_unwritable(path, error)) from None
    if path.exists():
        check_regular_file(path, "file to write")
    remove_stale_temp_files(path)
    backup_path: Path | None = None
    try:
        if backup and path.exists():
            old = path.read_bytes()
            if old == text.encode("utf-8"):
                return None
            backup_path = path.with_name(path.name + ".bak")
            _replace_with(backup_path, old, mode=path.stat().st_mode & 0o777)
        _replace_with(path, text.encode("utf-8"))
    except OSError as error:
        raise ConfigError(_unwritable(path, error)) from None
    return backup_path


def _unwritable(path: Path, error: OSError) -> str:
    where = Path(error.filename) if error.filename else path.parent
    blocker = next((p for p in [where, *where.parents] if p.exists() and not p.is_dir()), None)
    why = f"{blocker} is a file, not a folder" if blocker is not None and blocker != path else (error.strerror or str(error))
    return (
        f"Could not write {path}: {why}. Choose a path in a folder you can write to (check the path and "
        f"its permissions), then run the command again."
    )


_TEMP_SUFFIX = ".tmp"


def _temp_prefix(path: Path) -> str:
    return f".{path.name}."


def remove_stale_temp_files(path: Path) -> None:
    """Delete the temp files a killed writer left beside `path` and its backup (`.NAME.<pid>.*.tmp`,
    `.NAME.bak.<pid>.*.tmp`) when that writer (by pid) is no longer running. Every read and write of a
    config calls it; a folder we cannot write to is left as it is."""
    path = Path(os.path.realpath(path))
    for target in (path, path.with_name(path.name + ".bak")):
        _remove_stale_temps_of(target)


def _remove_stale_temps_of(path: Path) -> None:
    prefix = _temp_prefix(path)
    try:
        names = [n for n in os.listdir(path.parent) if n.startswith(prefix) and n.endswith(_TEMP_SUFFIX)]
    except OSError:
        return
    for name in names:
        pid_text = name[len(prefix):].split(".", 1)[0]
        if not pid_text.isdigit():
            continue  # `.NAME.bak.<pid>...`: the backup's own pass decides about it
        if _pid_alive(int(pid_text)):
            continue  # another writer is busy with it
        try:
            os.unlink(path.parent / name)
        except OSError:
            pass


def _pid_alive(pid: int) -> bool:
    import psutil

    if pid == os.getpid():
        return False  # ours can only be stale: this process writes one file at a time
    return psutil.pid_exists(pid)


def _current_umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def _replace_with(path: Path, data: bytes, *, mode: int | None = None) -> None:
    if mode is None:
        try:
            mode = path.stat().st_mode & 0o777
        except FileNotFoundError:
            mode = 0o666 & ~_current_umask()  # a new file: what open() would have made
    fd, tmp_name = tempfile.mkstemp(prefix=f"{_temp_prefix(path)}{os.getpid()}.", suffix=_TEMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    # make the rename itself durable
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def save_config_file(config: AnyConfig, path: str | os.PathLike[str], *, backup: bool = True) -> Path | None:
    """Write `config` to `path` (format by extension), atomically; returns the backup path if one was made."""
    return write_text_atomic(Path(path).expanduser(), config_text(config, path), backup=backup)
