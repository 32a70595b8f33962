"""The `env_report` task: what this machine has, as a result model and a markdown artifact."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from prefect_accelerate.envreport.probe import EnvReport, collect_env_report
from prefect_accelerate.envreport.render import render_markdown

ENV_ARTIFACT_KEY = "env-report"


def _retry_unless_config_error(task, task_run, state) -> bool:  # noqa: ARG001 - Prefect's signature
    """A probe can flake (a hung import check); a bad config file will not fix itself."""
    from prefect_accelerate.errors import ConfigError

    try:
        state.result()
    except ConfigError:
        return False
    except Exception:
        return True
    return False


@task(
    name="env-report", task_run_name="env-report", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2,
    retry_condition_fn=_retry_unless_config_error,
)
def env_report(config_file: str | Path | None = None, check_imports: bool = True) -> EnvReport:
    """Probe this machine (versions, accelerators, memory, config) and publish it as an artifact.

    Returns:
        The structured report, so a flow can gate on it (e.g. `report.accelerator_count`).
    """
    report = collect_env_report(config_file, check_imports=check_imports)
    create_markdown_artifact(
        key=ENV_ARTIFACT_KEY, markdown=render_markdown(report), description="prefect-accelerate env report"
    )
    get_run_logger().info("Environment report published as artifact %r", ENV_ARTIFACT_KEY)
    return report
