"""`preflight` and `launch_training`: the validated DAG that gates a launch.

config -> (env || memory) -> memory-fit -> deepspeed-check -> install-test -> [approval] -> launch

Unchanged steps come from Prefect's cache (content-hash keys, across runs and processes); a failed
step stops the pipeline before anything expensive starts, and the summary artifact says which step
failed and why. The launch runs in the flow's main thread and is never cached.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from prefect_accelerate.errors import PreflightError
from prefect_accelerate.flows.launch import end_launch_processes
from prefect_accelerate.pipeline import index
from prefect_accelerate.pipeline.graph import build_graph, launch_options
from prefect_accelerate.pipeline.models import PREFLIGHT_STEPS, PipelineRequest, PipelineResult, PreflightReport, StepOutcome
from prefect_accelerate.pipeline.steps import failure_text
from prefect_accelerate.tasks import pipeline as step_tasks

SUMMARY_ARTIFACT_KEY = "preflight-summary"
PIPELINE_ARTIFACT_KEY = "pipeline-summary"

_TASKS = {
    "config": step_tasks.config_step,
    "env": step_tasks.env_step,
    "memory": step_tasks.memory_step,
    "memory-fit": step_tasks.memory_fit_step,
    "deepspeed-check": step_tasks.deepspeed_step,
    "install-test": step_tasks.install_test_step,
}


def _run_name(prefix: str):
    def name() -> str:
        from prefect.runtime import flow_run

        request = flow_run.parameters.get("request")
        if request is None:
            return prefix
        config = Path(request.config_file).name if request.config_file else "default-config"
        processes = request.launch_flags.get("num_processes", "")
        return f"{prefix}-{_launcher_of(request)}{config}-{Path(request.script).stem}" + (f"-{processes}p" if processes else "")

    return name


def _launcher_of(request: PipelineRequest) -> str:
    """`<launcher>-` for the run name (torchrun, deepspeed, tpu, sagemaker...); empty when the options do not
    resolve yet (the config step then names the problem)."""
    from prefect_accelerate.launchers import choose_launcher

    try:
        return f"{choose_launcher(launch_options(request))}-"
    except Exception:  # noqa: BLE001 - a run name must never fail the run
        return ""


class _Runner:
    """Runs step tasks in DAG order and keeps the summary rows."""

    def __init__(self, request: PipelineRequest) -> None:
        self.request = request
        self.graph = build_graph(request, with_status=False)
        self.outcomes: dict[str, StepOutcome] = {}
        self.results: dict[str, Any] = {}
        self.failed: tuple[str, str] | None = None

    def _call(self, name: str, *extra: Any, submit: bool = False):
        step = self.graph.step(name)
        task = _TASKS[name].with_options(refresh_cache=self.request.forced(name))
        args = (self.request, *extra)
        kwargs = dict(key=step.key or f"pa-{name}-unkeyed")
        started = time.monotonic()
        if submit:
            return task.submit(*args, **kwargs), started
        return task(*args, **kwargs, return_state=True), started

    def finish(self, name: str, state, started: float) -> bool:
        duration = round(time.monotonic() - started, 2)
        if state.is_completed():
            self.results[name] = state.result()
            cached = state.name == "Cached"
            step = self.graph.step(name)
            if step.key:
                index.record(self.graph.pipeline_id, name, step.key, step.inputs)
            reason = "inputs unchanged" if cached else self.graph.step(name).reason or ""
            if name == "config":  # an old-format config is worth seeing in the summary, not only in the task log
                notes = getattr(self.results[name], "notes", None) or []
                migrated = [note for note in notes if "older format" in note]
                if migrated:
                    reason = f"{reason}; {migrated[0]}" if reason else migrated[0]
            self.outcomes[name] = StepOutcome(step=name, status="cached" if cached else "ran", duration_s=duration, reason=reason)
            return True
        error = state.result(raise_on_failure=False)
        text = failure_text(error) if isinstance(error, BaseException) else str(state.message or state.name)
        self.outcomes[name] = StepOutcome(step=name, status="failed", duration_s=duration, reason=text)
        self.failed = (name, text)
        return False

    def run(self, name: str, *extra: Any) -> bool:
        if self.failed or not self.graph.step(name).enabled:
            return self.failed is None
        state, started = self._call(name, *extra)
        return self.finish(name, state, started)

    def report(self) -> PreflightReport:
        rows = []
        for name in PREFLIGHT_STEPS:
            step = self.graph.step(name)
            if name in self.outcomes:
                rows.append(self.outcomes[name])
            elif not step.enabled:
                rows.append(StepOutcome(step=name, status="skipped", reason=f"not needed: {step.reason}"))
            else:
                rows.append(StepOutcome(step=name, status="skipped", reason=f"not run: step {self.failed[0]} failed" if self.failed else ""))
        ok = self.failed is None
        message = "Every preflight step passed." if ok else f"Preflight step {self.failed[0]} failed: {self.failed[1]}"
        data = {k: (v.model_dump(mode="json") if hasattr(v, "model_dump") else v) for k, v in self.results.items()}
        return PreflightReport(ok=ok, steps=rows, failed_step=self.failed[0] if self.failed else None, message=message, results=data)


def summary_rows(report: PreflightReport) -> list[dict[str, Any]]:
    return [
        {"step": s.step, "status": s.status, "duration_s": s.duration_s if s.duration_s is not None else "", "reason": s.reason}
        for s in report.steps
    ]


def run_preflight(request: PipelineRequest) -> PreflightReport:
    """The preflight DAG (must be called inside a flow). Never raises for a failed step; see `report.ok`."""
    runner = _Runner(request)
    if runner.run("config"):
        env_future = memory_future = None
        if runner.graph.step("env").enabled:
            env_future = runner._call("env", submit=True)
        if runner.graph.step("memory").enabled:
            memory_future = runner._call("memory", submit=True)
        for name, pending in (("env", env_future), ("memory", memory_future)):  # in parallel; both finish
            if pending is not None:
                future, started = pending
                future.wait()
                runner.finish(name, future.state, started)
        estimate = runner.results.get("memory")
        if estimate is not None:
            runner.run("memory-fit", estimate)
        runner.run("deepspeed-check", estimate)
        runner.run("install-test")
    report = runner.report()
    create_table_artifact(key=SUMMARY_ARTIFACT_KEY, table=summary_rows(report), description=report.message)
    return report


@flow(name="preflight", flow_run_name=_run_name("preflight"), on_cancellation=[end_launch_processes], on_crashed=[end_launch_processes])
def preflight(request: PipelineRequest) -> PreflightReport:
    """Check everything a launch needs, reusing cached steps; raises PreflightError naming the failed step."""
    report = run_preflight(request)
    logger = get_run_logger()
    for step in report.steps:
        logger.info("%-16s %-8s %s", step.step, step.status, step.reason)
    if not report.ok:
        raise PreflightError(report.message)
    return report


def approval_description(request: PipelineRequest, report: PreflightReport, plan_json: dict[str, Any]) -> str:
    import json

    lines = ["## Approve this launch?", "", f"Script: `{request.script} {' '.join(request.script_args)}`", ""]
    fit = report.results.get("memory-fit")
    if fit:
        lines += [f"**Memory:** {fit.get('message')}", ""]
    lines += ["| step | status | reason |", "|---|---|---|"] + [f"| {s.step} | {s.status} | {s.reason} |" for s in report.steps]
    lines += ["", "Launch plan:", "```json", json.dumps(plan_json, indent=2), "```"]
    return "\n".join(lines)


def ask_for_approval(request: PipelineRequest, report: PreflightReport, plan_json: dict[str, Any], timeout: int = 3600) -> bool:
    from prefect.flow_runs import pause_flow_run
    from prefect.input import RunInput

    class LaunchApproval(RunInput):
        approve: bool = False
        note: str = ""

    answer = pause_flow_run(
        wait_for_input=LaunchApproval.with_initial_data(description=approval_description(request, report, plan_json), approve=False),
        timeout=timeout,
    )
    if answer.note:
        get_run_logger().info("Approval note: %s", answer.note)
    return bool(answer.approve)


@flow(name="launch-training", flow_run_name=_run_name("launch-training"), on_cancellation=[end_launch_processes], on_crashed=[end_launch_processes])
def launch_training(request: PipelineRequest) -> PipelineResult:
    """Preflight, then (after approval, when asked for) the training launch in this flow's main thread."""
    from prefect_accelerate.launchers import plan_launch
    from prefect_accelerate.tasks.launch import launch

    logger = get_run_logger()
    report = run_preflight(request)
    for step in report.steps:
        logger.info("%-16s %-8s %s", step.step, step.status, step.reason)
    if not report.ok:
        _pipeline_artifact(report, launched=False, note="stopped before the launch")
        raise PreflightError(report.message + " Nothing was launched.")
    options = launch_options(request)
    plan = plan_launch(options, cwd=request.cwd)
    approved = None
    if request.require_approval:
        approved = ask_for_approval(request, report, plan.to_json_dict())
        if not approved:
            logger.warning("The launch was not approved; nothing was started.")
            _pipeline_artifact(report, launched=False, note="not approved")
            return PipelineResult(preflight=report, launched=False, approved=False)
    try:
        result = launch(options=options, plan=plan)
    except BaseException as error:
        _pipeline_artifact(report, launched=True, note=f"the launch failed: {failure_text(error)}"[:500])
        raise
    _pipeline_artifact(report, launched=True, note=f"launch exit code {result.exit_code} in {result.duration_s:.1f} s")
    return PipelineResult(preflight=report, launched=True, approved=approved, launch=result)


def _pipeline_artifact(report: PreflightReport, *, launched: bool, note: str) -> None:
    rows = summary_rows(report) + [{"step": "launch", "status": "ran" if launched else "skipped", "duration_s": "", "reason": note}]
    create_table_artifact(key=PIPELINE_ARTIFACT_KEY, table=rows, description=report.message)
