"""`validate_configs`: preflight over many config files with bounded concurrency (the nightly validation).

The machine is probed once; each config's checks run as one task, cached on the keys of its steps,
so an unchanged config is not re-tested. A config whose checks fail is a Failed task run (red in the UI,
never cached). One summary table artifact covers the whole matrix, and the flow run ends Failed when any
config fails, by returning a Failed state (whose exception is a PreflightError for Python callers), so
no Prefect traceback precedes the one-paragraph error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.futures import wait
from prefect.states import Failed

from prefect_accelerate.errors import PreflightError
from prefect_accelerate.flows.launch import end_launch_processes
from prefect_accelerate.pipeline.models import ConfigValidation, ValidationReport, ValidationRequest
from prefect_accelerate.pipeline.validate import expand_configs, request_for, validate_one, validation_key

VALIDATION_ARTIFACT_KEY = "config-validation"


def _key(context: Any, parameters: dict[str, Any]) -> str:  # noqa: ARG001
    return parameters["key"]


def _name() -> str:
    from prefect.runtime import task_run

    return f"validate-{Path(task_run.parameters.get('config_file', 'config')).name}"


@task(name="validate-config", task_run_name=_name, cache_key_fn=_key, persist_result=True, cache_expiration=None)
def validate_config(config_file: str, validation: ValidationRequest, key: str):
    result = validate_one(config_file, validation)
    logger = get_run_logger()
    (logger.info if result.ok else logger.error)("%s: %s", config_file, result.message)
    if not result.ok:
        # a failed check is a Failed task run (and so never cached); the flow reads the result from its data
        return Failed(message=f"{Path(config_file).name}: {result.message}", data=result)
    return result


@task(name="probe-machine", task_run_name="probe-machine", retries=1, retry_delay_seconds=2)
def probe_machine():
    from prefect_accelerate.pipeline.steps import env_step

    return env_step()


def _validation_run_name() -> str:
    from prefect.runtime import flow_run

    request = flow_run.parameters.get("request")
    count = len(request.configs) if request is not None else 0
    return f"validate-configs-{count}-pattern{'s' if count != 1 else ''}"


@flow(name="validate-configs", flow_run_name=_validation_run_name, on_cancellation=[end_launch_processes], on_crashed=[end_launch_processes])
def validate_configs(request: ValidationRequest):
    """Preflight every config in `request.configs`; raises PreflightError when any fails (after the artifact)."""
    configs = expand_configs(request.configs)
    probe_machine()
    results: list[ConfigValidation] = []
    pending = list(configs)
    while pending:  # at most max_concurrency configs at a time (each may start a self-test)
        batch, pending = pending[: request.max_concurrency], pending[request.max_concurrency:]
        forced = bool(request.force)
        futures = [
            validate_config.with_options(refresh_cache=forced).submit(path, request, validation_key(request_for(path, request)), return_state=False)
            for path in batch
        ]
        wait(futures)
        for path, future in zip(batch, futures, strict=True):
            state = future.state
            if state.is_completed():
                results.append(future.result())
                continue
            value = state.result(raise_on_failure=False)
            if isinstance(value, ConfigValidation):
                results.append(value)
            else:
                results.append(ConfigValidation(config_file=path, ok=False, failed_step="task", message=str(value)))
    report = ValidationReport(ok=all(r.ok for r in results), configs=results)
    rows = [{"config": Path(r.config_file).name, "ok": "yes" if r.ok else "NO", "failed step": r.failed_step or "", "message": r.message[:300]} for r in results]
    create_table_artifact(key=VALIDATION_ARTIFACT_KEY, table=rows, description=f"{sum(r.ok for r in results)}/{len(results)} configs passed")
    if not report.ok:
        bad = [f"{Path(r.config_file).name} ({r.failed_step}: {r.message})" for r in results if not r.ok]
        message = f"{len(bad)} of {len(results)} config(s) failed validation: " + "; ".join(bad)
        get_run_logger().error(message)
        return Failed(message=message, data=PreflightError(message))
    return report
