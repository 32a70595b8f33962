"""`check_environment`: load (or create) the config, then report on this machine."""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger

from prefect_accelerate.config.paths import config_missing
from prefect_accelerate.envreport.probe import EnvReport
from prefect_accelerate.tasks.config import config_default, load_config
from prefect_accelerate.tasks.env import env_report


def _check_run_name() -> str:
    from prefect.runtime import flow_run

    config_file = flow_run.parameters.get("config_file")
    return f"check-environment-{Path(config_file).name if config_file else 'default'}"


@flow(name="check-environment", flow_run_name=_check_run_name, log_prints=True)
def check_environment(config_file: str | None = None, create_if_missing: bool = True, mixed_precision: str = "no") -> EnvReport:
    """Load the Accelerate config (writing a default one first when there is none), then probe this machine.

    Args:
        config_file: the config to use; the default config when None.
        create_if_missing: write a config for this machine (`config default`) when the file does not exist.
        mixed_precision: precision for a config written here.

    Returns:
        The environment report, including the config that was used.
    """
    if config_missing(config_file) and create_if_missing:
        # the config-default task logs "configuration saved at ..." once; this says why it ran
        get_run_logger().info("No Accelerate config was found, so this run writes a default one for this machine.")
        config_default(config_file, mixed_precision)
    loaded = load_config(config_file)
    # keep "default" vs "passed" in the report: pass the path only when the user named it
    return env_report(str(loaded.path) if loaded.location.source == "passed" else None)


@flow(name="env", log_prints=True)
def env_flow(config_file: str | None = None, check_imports: bool = True) -> EnvReport:
    """The `env` report as a tracked flow run (one task and its artifact)."""
    return env_report(config_file, check_imports)
