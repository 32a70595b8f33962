"""`to-fsdp2`: turn an FSDP1 config into an FSDP2 one (reference §9), with Accelerate's checks and key map.

Differences: the result is validated before anything is written (so a broken input is reported, not
copied), writes are atomic with a `.bak` of a replaced file, JSON files are accepted, and keys written
without the `fsdp_` prefix are converted too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from prefect_accelerate.config.enums import FSDP1_TO_FSDP2_RESHARD, FSDP_SHARDING_STRATEGY
from prefect_accelerate.config.io import check_regular_file, config_text, migrate, parse_config, read_raw, write_text_atomic
from prefect_accelerate.config.model import FSDPSection
from prefect_accelerate.errors import ConfigError

#: FSDP1 keys FSDP2 no longer has, and why they are dropped
FSDP2_REMOVED = {
    "fsdp_backward_prefetch": "removed in FSDP2",
    "fsdp_sync_module_states": "removed in FSDP2",
    "fsdp_use_orig_params": "removed in FSDP2",
    "fsdp_forward_prefetch": "not yet implemented in FSDP2",
}


class Fsdp2Result(BaseModel):
    """What `to-fsdp2` wrote, and notes on the keys it dropped."""

    model_config = ConfigDict(frozen=True)

    output: Path
    notes: list[str] = Field(default_factory=list)
    converted: bool = True
    backup: Path | None = None

    def message(self) -> str:
        lines = [*self.notes]
        if self.converted:
            lines.append(f"Wrote the FSDP2 config to {self.output}.")
        if self.backup is not None:
            lines.append(f"The previous content is kept in {self.backup}.")
        return "\n".join(lines)


def _reshard_value(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= len(FSDP_SHARDING_STRATEGY):
        value = FSDP_SHARDING_STRATEGY[value - 1]
    if isinstance(value, str) and value.upper() in FSDP1_TO_FSDP2_RESHARD:
        return FSDP1_TO_FSDP2_RESHARD[value.upper()]
    return value


def convert_fsdp_section(fsdp: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The FSDP2 form of an FSDP1 `fsdp_config` and notes on what was dropped. Pure."""
    out: dict[str, Any] = {}
    notes: list[str] = []
    for key, value in fsdp.items():
        name = FSDPSection.canonical(key)
        if name in FSDP2_REMOVED:
            notes.append(f"Dropped {key}: {FSDP2_REMOVED[name]}.")
            continue
        if name in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward"):
            out["fsdp_reshard_after_forward"] = _reshard_value(value)  # the later key wins
            continue
        out[key] = value
    out["fsdp_version"] = 2
    out.pop("version", None)
    return out, notes


def convert_to_fsdp2(
    config_file: str | os.PathLike[str],
    output_file: str | os.PathLike[str] | None = None,
    *,
    overwrite: bool = False,
) -> Fsdp2Result:
    """Convert `config_file` to FSDP2 and write it to `output_file` (or in place with `overwrite`)."""
    source = Path(config_file).expanduser()
    if source.exists() or source.is_symlink():
        check_regular_file(source)
    if not source.is_file():
        raise ConfigError(f"The config file {source} was not found. Pass an existing FSDP1 config with --config_file.")
    if output_file is None and not overwrite:
        raise ConfigError(
            "to-fsdp2 needs somewhere to write: pass --output_file NEW_FILE, or --overwrite to convert "
            f"{source} in place (its old content is then kept as {source}.bak)."
        )
    target = Path(output_file).expanduser() if output_file is not None else source
    if not overwrite and target.exists():
        raise ConfigError(f"The output file {target} already exists. Choose another --output_file, or pass --overwrite to replace it.")
    raw = read_raw(source)
    fsdp = raw.get("fsdp_config") or {}
    notes: list[str] = []
    if not isinstance(fsdp, dict):
        raise ConfigError(f"The config file {source} has an `fsdp_config` that is not a mapping. Fix the file, then convert it.")
    converted = dict(raw)
    if not fsdp:
        return Fsdp2Result(output=target, notes=[f"{source} has no fsdp_config, so there is nothing to convert; nothing was written."], converted=False)
    if str(fsdp.get("fsdp_version", fsdp.get("version", 1))).strip() == "2":
        return Fsdp2Result(output=target, converted=False, notes=[
            "The config already specifies FSDP2, so it was not converted and nothing was written. If it still uses "
            "FSDP1 key names, set fsdp_version to 1 and run to-fsdp2 again."
        ])
    converted["fsdp_config"], dropped = convert_fsdp_section(fsdp)
    notes.extend(dropped)
    data, _ = migrate(converted, source)
    parse_config(data, source)  # refuse to write something that does not load
    text = config_text(converted, target)
    backup = write_text_atomic(target, text, backup=True)
    return Fsdp2Result(output=target, notes=notes, converted=True, backup=backup)

