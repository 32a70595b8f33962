"""One-task flows for the config commands, so `--track` records them as flow runs."""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from prefect_accelerate.config.defaults import DefaultConfigResult
from prefect_accelerate.config.fsdp2 import Fsdp2Result
from prefect_accelerate.config.update import UpdateResult
from prefect_accelerate.tasks.config import config_default, config_update, to_fsdp2


@flow(name="config-default", log_prints=True)
def config_default_flow(config_file: str | None = None, mixed_precision: str = "no", force: bool = False) -> DefaultConfigResult:
    return config_default(config_file, mixed_precision, force)


@flow(name="config-update", log_prints=True)
def config_update_flow(config_file: str | None = None) -> UpdateResult:
    return config_update(config_file)


@flow(name="to-fsdp2", log_prints=True)
def to_fsdp2_flow(config_file: str, output_file: str | None = None, overwrite: bool = False) -> Fsdp2Result:
    return to_fsdp2(Path(config_file), output_file, overwrite)
