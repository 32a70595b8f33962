"""Prefect tasks over the config-file operations (prefect_accelerate.config)."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from prefect_accelerate.config.defaults import DefaultConfigResult, write_default_config
from prefect_accelerate.config.fsdp2 import Fsdp2Result, convert_to_fsdp2
from prefect_accelerate.config.io import LoadedConfig, load_config_file
from prefect_accelerate.config.update import UpdateResult, update_config_file


def _name(config_file: str | Path | None) -> str:
    return Path(config_file).name if config_file else "default"


def _config_run_name(prefix: str):
    def name() -> str:
        from prefect.runtime import task_run

        return f"{prefix}-{_name(task_run.parameters.get('config_file'))}"

    return name


@task(name="config-default", task_run_name=_config_run_name("config-default"), cache_policy=NO_CACHE)
def config_default(config_file: str | Path | None = None, mixed_precision: str = "no", force: bool = False) -> DefaultConfigResult:
    """Write a config for this machine unless one exists (`prefect-accelerate config default`)."""
    result = write_default_config(config_file, mixed_precision, force=force)
    get_run_logger().info(result.message())
    return result


@task(name="config-update", task_run_name=_config_run_name("config-update"), cache_policy=NO_CACHE)
def config_update(config_file: str | Path | None = None) -> UpdateResult:
    """Migrate a config file to the current format in place, keeping `<file>.bak`."""
    result = update_config_file(config_file)
    logger = get_run_logger()
    logger.info(result.location.describe())
    logger.info(result.message())
    return result


@task(name="load-config", task_run_name=_config_run_name("load-config"), cache_policy=NO_CACHE)
def load_config(config_file: str | Path | None = None) -> LoadedConfig:
    """Load and validate a config (migrating an old format in memory, and saying so)."""
    loaded = load_config_file(config_file)
    assert loaded is not None  # required=True raises instead
    logger = get_run_logger()
    logger.info(loaded.location.describe())
    for change in loaded.migration.legacy_changes:
        logger.warning("Old config format, migrated in memory: %s (run `prefect-accelerate config update` to save it)", change)
    return loaded


@task(name="to-fsdp2", task_run_name=_config_run_name("to-fsdp2"), cache_policy=NO_CACHE)
def to_fsdp2(config_file: str | Path, output_file: str | Path | None = None, overwrite: bool = False) -> Fsdp2Result:
    """Convert an FSDP1 config to FSDP2."""
    result = convert_to_fsdp2(config_file, output_file, overwrite=overwrite)
    get_run_logger().info(result.message())
    return result
