"""Preflight steps as Prefect tasks, cached across runs on their content-hash keys (pipeline/keys.py).

Each task receives its key (computed by pipeline/graph.py) so that the cache key is exactly what
`prefect-accelerate plan` shows. The flow records every completed step (run or cached) in the
pipeline index that `plan` reads.
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task

from prefect_accelerate.pipeline import steps
from prefect_accelerate.pipeline.models import PipelineRequest


def _key(context: Any, parameters: dict[str, Any]) -> str:  # noqa: ARG001 - Prefect's signature
    return parameters["key"]


def _name(step: str):
    def name() -> str:
        from pathlib import Path

        from prefect.runtime import task_run

        request = task_run.parameters.get("request")
        config = Path(request.config_file).name if request is not None and request.config_file else "default"
        return f"{step}-{config}"

    return name


def _step_options(step: str, **extra: Any) -> dict[str, Any]:
    return dict(name=f"preflight-{step}", task_run_name=_name(step), cache_key_fn=_key, persist_result=True, cache_expiration=None, **extra)


@task(**_step_options("config"))
def config_step(request: PipelineRequest, key: str) -> steps.ConfigCheck:
    """Load, migrate in memory and validate the config with the launch flags."""
    result = steps.config_step(request)
    logger = get_run_logger()
    for note in result.notes:
        logger.info(note)
    for warning in result.warnings:
        logger.warning(warning)
    return result


@task(**_step_options("env", retries=1, retry_delay_seconds=2))
def env_step(request: PipelineRequest, key: str):
    """Probe this machine (the `env` report)."""
    from prefect.artifacts import create_markdown_artifact

    from prefect_accelerate.envreport.render import render_markdown

    report = steps.env_step()
    create_markdown_artifact(key="env-report", markdown=render_markdown(report), description="prefect-accelerate env report")
    return report


@task(**_step_options("memory"))
def memory_step(request: PipelineRequest, key: str):
    """Size the model on the meta device for this launch's layout."""
    estimate = steps.memory_step(request)
    if estimate.breakdown is not None:
        get_run_logger().info("%s per device (%s)", estimate.breakdown.device_total, estimate.breakdown.strategy)
    return estimate


@task(**_step_options("memory-fit"))
def memory_fit_step(request: PipelineRequest, estimate, key: str):
    """Gate: the estimate fits one device with headroom (raises PreflightError otherwise)."""
    verdict = steps.memory_fit_step(request, estimate)
    get_run_logger().info(verdict.message)
    return verdict


@task(**_step_options("deepspeed-check"))
def deepspeed_step(request: PipelineRequest, estimate, key: str):
    """DeepSpeed importable, its accelerator and backend, ZeRO model-state memory."""
    check = steps.deepspeed_step(request, estimate)
    return check


@task(**_step_options("install-test"))
def install_test_step(request: PipelineRequest, key: str):
    """The distributed self-test through the same launcher and options as the launch."""
    from prefect.artifacts import create_markdown_artifact

    logger = get_run_logger()
    report = steps.install_test_step(request, on_line=lambda label, line: logger.info("[%s] %s", label, line))
    create_markdown_artifact(key="install-test", markdown=report.markdown(), description="prefect-accelerate self-test")
    return report
