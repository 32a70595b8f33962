"""`config default`: a config for this machine from what torch detects (reference §2.2).

Unlike Accelerate, YAML goes into a `.yaml` file (Accelerate writes JSON text there), an existing file
is only replaced with `force` (and then kept as `.bak`), and MLU hosts are detected (Accelerate 1.14
fell back to CPU there).
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from prefect_accelerate.config.enums import PrecisionType
from prefect_accelerate.config.io import save_config_file
from prefect_accelerate.config.model import ClusterConfig
from prefect_accelerate.config.paths import default_config_path
from prefect_accelerate.envreport.devices import AcceleratorInfo, detect_accelerator
from prefect_accelerate.errors import ConfigError

DEFAULT_MIXED_PRECISION_CHOICES = ("no", "fp16", "bf16")


def build_default_config(mixed_precision: str = "no", accelerator: AcceleratorInfo | None = None) -> ClusterConfig:
    """The config `config default` writes for `accelerator` (detected when None). Pure apart from detection."""
    precision = mixed_precision.lower()
    if precision not in PrecisionType.values():
        raise ConfigError(
            f"--mixed_precision {mixed_precision!r} is not a precision mode. Use one of "
            f"{', '.join(DEFAULT_MIXED_PRECISION_CHOICES)} (or fp8 from Python)."
        )
    info = detect_accelerator() if accelerator is None else accelerator
    multi = info.kind is not None and info.kind != "mps"
    return ClusterConfig(
        compute_environment="LOCAL_MACHINE",
        distributed_type=info.default_distributed_type(),
        mixed_precision=precision,
        use_cpu=info.kind is None,
        num_processes=max(info.count, 1) if multi else 1,
        debug=False,
        enable_cpu_affinity=False,
    )


class DefaultConfigResult(BaseModel):
    """What `config default` did."""

    model_config = ConfigDict(frozen=True)

    path: Path
    config: ClusterConfig
    written: bool
    backup: Path | None = None

    def message(self) -> str:
        if not self.written:
            return (
                f"Configuration already exists at {self.path}; it was not overwritten. Pass --force to replace it "
                f"(the old file is kept as {self.path}.bak), or --config_file to write somewhere else."
            )
        text = f"accelerate configuration saved at {self.path}"
        if self.backup is not None:
            text += f" (previous content kept in {self.backup})"
        return text


def write_default_config(
    config_file: str | os.PathLike[str] | None = None,
    mixed_precision: str = "no",
    *,
    force: bool = False,
    accelerator: AcceleratorInfo | None = None,
) -> DefaultConfigResult:
    """Write the default config for this machine, unless a file is already there (see `force`).

    Args:
        config_file: where to write; the default location (resolved now) when None.
        mixed_precision: no, fp16 or bf16 (fp8 is accepted from Python, as in Accelerate).
        force: replace an existing file, keeping its content as `<file>.bak`.
        accelerator: the hardware to describe; detected through torch when None.

    Returns:
        What happened: the path, the config, and whether it was written.
    """
    path = Path(config_file).expanduser() if config_file is not None else default_config_path()
    if path.is_dir():
        raise ConfigError(f"--config_file {path} is a folder. Pass a file path ending in .yaml or .json.")
    config = build_default_config(mixed_precision, accelerator)
    if path.exists() and not force:
        return DefaultConfigResult(path=path, config=config, written=False)
    backup = save_config_file(config, path, backup=True)
    return DefaultConfigResult(path=path, config=config, written=True, backup=backup)
