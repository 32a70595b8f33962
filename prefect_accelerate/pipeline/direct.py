"""The pipeline without Prefect (`--no-track`, and the benchmark's baseline): the same steps, no caching."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prefect_accelerate.errors import PreflightError
from prefect_accelerate.pipeline import steps
from prefect_accelerate.pipeline.graph import build_graph, launch_options
from prefect_accelerate.pipeline.models import PREFLIGHT_STEPS, PipelineRequest, PipelineResult, PreflightReport, StepOutcome


def run_preflight_direct(
    request: PipelineRequest, on_line: Callable[[str, str], None] | None = None, *, skip: frozenset[str] = frozenset()
) -> PreflightReport:
    """The preflight steps in order, in this process; `skip` leaves steps out (e.g. env, probed once elsewhere)."""
    graph = build_graph(request, with_status=False)
    outcomes: list[StepOutcome] = []
    results: dict[str, Any] = {}
    failed: tuple[str, str] | None = None
    calls = {
        "config": lambda: steps.config_step(request),
        "env": steps.env_step,
        "memory": lambda: steps.memory_step(request),
        "memory-fit": lambda: steps.memory_fit_step(request, results["memory"]),
        "deepspeed-check": lambda: steps.deepspeed_step(request, results.get("memory")),
        "install-test": lambda: steps.install_test_step(request, on_line=on_line),
    }
    for name in PREFLIGHT_STEPS:
        step = graph.step(name)
        if name in skip:
            continue
        if not step.enabled:
            outcomes.append(StepOutcome(step=name, status="skipped", reason=f"not needed: {step.reason}"))
            continue
        if failed:
            outcomes.append(StepOutcome(step=name, status="skipped", reason=f"not run: step {failed[0]} failed"))
            continue
        started = time.monotonic()
        try:
            results[name] = calls[name]()
            outcomes.append(StepOutcome(step=name, status="ran", duration_s=round(time.monotonic() - started, 2)))
        except Exception as error:
            failed = (name, steps.failure_text(error), steps.failure_exit_code(error))
            outcomes.append(StepOutcome(step=name, status="failed", duration_s=round(time.monotonic() - started, 2), reason=failed[1]))
    message = "Every preflight step passed." if failed is None else f"Preflight step {failed[0]} failed: {failed[1]}"
    data = {k: (v.model_dump(mode="json") if hasattr(v, "model_dump") else v) for k, v in results.items()}
    return PreflightReport(ok=failed is None, steps=outcomes, failed_step=failed[0] if failed else None, message=message,
                          exit_code=failed[2] if failed else 0, results=data)


def run_pipeline_direct(request: PipelineRequest, on_line: Callable[[str, str], None] | None = None) -> PipelineResult:
    """Preflight then launch, in this process, without Prefect. Raises PreflightError when a step fails."""
    from prefect_accelerate.launchers import plan_launch
    from prefect_accelerate.launchers.execute import execute

    report = run_preflight_direct(request, on_line=on_line)
    if not report.ok:
        raise PreflightError(report.message + " Nothing was launched.", exit_code=report.exit_code)
    options = launch_options(request)
    result = execute(plan_launch(options, cwd=request.cwd), on_line=on_line, timeout=options.timeout, grace=options.grace_period)
    return PipelineResult(preflight=report, launched=True, launch=result.raise_for_failure())
