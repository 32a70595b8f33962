"""`estimate_memory_flow`: the estimate as a tracked flow run (the CLI's `--track`), with the fit verdict."""

from __future__ import annotations

from pathlib import PurePath

from prefect import flow

from prefect_accelerate.memory.choices import DEFAULT_RESERVE_FRACTION
from prefect_accelerate.memory.models import EstimateOptions, FitVerdict, MemoryEstimate
from prefect_accelerate.tasks.memory import estimate_memory, memory_fit


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    model = str(flow_run.parameters.get("model", "model"))
    return f"estimate-memory-{PurePath(model).name or model}"


@flow(name="estimate-memory", flow_run_name=_flow_run_name, log_prints=True)
def estimate_memory_flow(model: str, options: EstimateOptions | None = None, device_memory: str | int | None = None,
                         check: bool = False, reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
                         gate: bool = False) -> tuple[MemoryEstimate, FitVerdict | None]:
    """Estimate a model's memory and, when asked, judge the fit on one device.

    Args:
        model: a folder with config.json, a Hub repo id (HF cache first), or a timm architecture name.
        options: dtypes and the training layout (a strategy is needed for the verdict).
        device_memory: ``"80GiB"``; None with ``check=True`` detects this machine's devices.
        check: judge the fit (implied by ``device_memory``).
        reserve_fraction: an extra share of each device kept back, on top of the modelled CUDA context and
            fragmentation (docs/memory.md).
        gate: fail the flow when the run would not fit (the preflight behaviour).

    Returns:
        (estimate, verdict or None).
    """
    state = estimate_memory(model, options, return_state=True)
    result = state.result()
    if state.name == "Cached":  # the run that reuses the estimate shows it too, under the cached task run
        from prefect_accelerate.tasks.artifacts import estimate_markdown, publish
        from prefect_accelerate.tasks.memory import ESTIMATE_ARTIFACT_KEY

        publish(ESTIMATE_ARTIFACT_KEY, markdown=estimate_markdown(result), task_run_id=state.state_details.task_run_id,
                description=f"Memory needed by {result.source.name} (from the cache: same model config and options)")
    verdict = None
    if check or device_memory is not None:
        verdict = memory_fit(result, device_memory, reserve_fraction, raise_on_failure=gate)
    return result, verdict
