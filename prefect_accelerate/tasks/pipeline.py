"""Preflight steps as Prefect tasks, cached across runs on their content-hash keys (pipeline/keys.py).

Each task receives its key (computed by pipeline/graph.py) so that the cache key is exactly what
`prefect-accelerate plan` shows. The flow records every completed step (run or cached) in the
pipeline index that `plan` reads, and publishes each step's artifact (tasks/artifacts.py) under the
step's task run, cached or not.

An expected failure (a PrefectAccelerateError: the gate said no, the config is wrong) ends the task in
a Failed state carrying the message: one ERROR record, no traceback. Anything else is a bug and keeps
Prefect's traceback.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from prefect import get_run_logger, task
from prefect.states import Failed

from prefect_accelerate.errors import PrefectAccelerateError, PreflightError
from prefect_accelerate.pipeline import steps
from prefect_accelerate.pipeline.models import PipelineRequest


def _key(context: Any, parameters: dict[str, Any]) -> str:  # noqa: ARG001 - Prefect's signature
    return parameters["key"]


def _name(step: str):
    def name() -> str:
        from prefect.runtime import task_run

        from prefect_accelerate.pipeline.naming import NO_CONFIG, config_name

        request = unquoted(task_run.parameters.get("request"))
        config = config_name(request) if request is not None else NO_CONFIG
        return step if config == NO_CONFIG else f"{step}-{config}"

    return name


def unquoted(value: Any) -> Any:
    """The value inside Prefect's `quote` (the flow quotes arguments so that Prefect records only the DAG's edges)."""
    return value.unquote() if hasattr(value, "unquote") else value


class _OneErrorRecord(logging.Filter):
    """Prefect logs a task that returns a Failed state twice at ERROR: "Task run failed with state: ..." (with an
    empty traceback, "NoneType: None") and "Finished in state Failed('...')". For our expected failures the
    second says it all; this drops the first, and only for the messages this module failed a task with."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: set[str] = set()
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Task run failed with state"):
            return True
        text = record.getMessage()
        with self.lock:
            return not any(message in text for message in self.messages)


_ONE_ERROR = _OneErrorRecord()
logging.getLogger("prefect.task_runs").addFilter(_ONE_ERROR)


def _expected_failure(error: PrefectAccelerateError):
    """The task's Failed state for an expected failure: its message, logged once, without a traceback."""
    with _ONE_ERROR.lock:
        _ONE_ERROR.messages.add(repr(error.message)[1:-1][:200])
    return Failed(message=error.message)


def _step_options(step: str, **extra: Any) -> dict[str, Any]:
    return dict(name=f"preflight-{step}", task_run_name=_name(step), cache_key_fn=_key, persist_result=True, cache_expiration=None, **extra)


@task(**_step_options("config"))
def config_step(request: PipelineRequest, key: str) -> steps.ConfigCheck:
    """Load, migrate in memory and validate the config with the launch flags."""
    try:
        result = steps.config_step(request)
    except PrefectAccelerateError as error:
        return _expected_failure(error)
    logger = get_run_logger()
    for note in result.notes:
        logger.info(note)
    for warning in result.warnings:
        logger.warning(warning)
    return result


@task(**_step_options("env", retries=1, retry_delay_seconds=2))
def env_step(request: PipelineRequest, key: str):
    """Probe this machine (the `env` report)."""
    return steps.env_step()


@task(**_step_options("memory"))
def memory_step(request: PipelineRequest, key: str):
    """Size the model on the meta device for this launch's layout."""
    try:
        estimate = steps.memory_step(request)
    except PrefectAccelerateError as error:
        return _expected_failure(error)
    if estimate.breakdown is not None:
        get_run_logger().info("%s per device (%s)", estimate.breakdown.device_total, estimate.breakdown.strategy)
    return estimate


@task(**_step_options("memory-fit"))
def memory_fit_step(request: PipelineRequest, estimate, key: str):
    """Gate: the estimate fits one device with headroom (fails with the verdict otherwise)."""
    try:
        verdict = steps.memory_fit_verdict(request, estimate)
    except PrefectAccelerateError as error:
        return _expected_failure(error)
    if not verdict.fits:  # the gate said no: its verdict is the artifact a reader opens first
        from prefect_accelerate.pipeline.naming import artifact_key
        from prefect_accelerate.tasks.artifacts import fit_summary, publish, verdict_markdown

        publish(artifact_key("memory-fit", request), markdown=verdict_markdown(verdict), description=fit_summary(verdict))
        return _expected_failure(PreflightError(steps.fit_failure_message(verdict)))
    get_run_logger().info(verdict.message)
    return verdict


@task(**_step_options("deepspeed-check"))
def deepspeed_step(request: PipelineRequest, estimate, key: str):
    """DeepSpeed importable, its accelerator and backend, ZeRO model-state memory."""
    try:
        return steps.deepspeed_step(request, estimate)
    except PrefectAccelerateError as error:
        return _expected_failure(error)


@task(**_step_options("install-test"))
def install_test_step(request: PipelineRequest, key: str):
    """The distributed self-test through the same launcher and options as the launch."""
    logger = get_run_logger()
    try:
        return steps.install_test_step(request, on_line=lambda label, line: logger.info("[%s] %s", label, line))
    except PrefectAccelerateError as error:
        return _expected_failure(error)
