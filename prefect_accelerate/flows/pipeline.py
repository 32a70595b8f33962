"""`preflight` and `launch_training`: the validated DAG that gates a launch.

config -> (env || memory) -> memory-fit -> deepspeed-check -> install-test -> [approval] -> launch

Unchanged steps come from Prefect's cache (content-hash keys, across runs and processes); a failed
step stops the pipeline before anything expensive starts, and the summary artifact says which step
failed and why. The launch runs in the flow's main thread and is never cached.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.futures import PrefectTaskRunFuture
from prefect.states import Failed
from prefect.utilities.annotations import quote

from prefect_accelerate.errors import PrefectAccelerateError, PreflightError
from prefect_accelerate.flows.launch import end_launch_processes
from prefect_accelerate.pipeline import index, naming
from prefect_accelerate.pipeline.graph import build_graph, launch_options, upstream
from prefect_accelerate.pipeline.models import PREFLIGHT_STEPS, PipelineRequest, PipelineResult, PreflightReport, StepOutcome
from prefect_accelerate.pipeline.steps import failure_exit_code, failure_text
from prefect_accelerate.tasks import artifacts
from prefect_accelerate.tasks import pipeline as step_tasks

#: artifact kinds; each key is `<kind>-<pipeline>` (pipeline/naming.py), so a key's history is one pipeline's
SUMMARY_ARTIFACT = "preflight-summary"
PIPELINE_ARTIFACT = "pipeline-summary"
PLAN_ARTIFACT = "pipeline-plan"
STEP_ARTIFACTS = {"config": "config-check", "env": "env-report", "memory": "memory-estimate", "memory-fit": "memory-fit",
                  "deepspeed-check": "deepspeed-check", "install-test": "install-test"}

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
        return naming.run_name(prefix, request, _launcher_of(request))

    return name


def _launcher_of(request: PipelineRequest) -> str | None:
    """The launcher for the run name (torchrun, deepspeed, tpu, sagemaker...); None when the options do not
    resolve yet (the config step then names the problem)."""
    from prefect_accelerate.launchers import choose_launcher

    try:
        return choose_launcher(launch_options(request))
    except Exception:  # noqa: BLE001 - a run name must never fail the run
        return None


def _step_artifact(name: str, result: Any) -> tuple[str, str]:
    """(markdown, description) of one step's artifact."""
    if name == "config":
        return artifacts.config_markdown(result), "The config and launch flags this run was checked with"
    if name == "env":
        from prefect_accelerate.envreport.render import render_markdown

        return render_markdown(result), "This machine, as the env step probed it"
    if name == "memory":
        return artifacts.estimate_markdown(result), f"Memory needed per device by {result.source.name}"
    if name == "memory-fit":
        return artifacts.verdict_markdown(result), artifacts.fit_summary(result)
    if name == "deepspeed-check":
        return artifacts.deepspeed_markdown(result), "DeepSpeed, its backend and ZeRO model-state memory"
    return result.markdown(), "The distributed self-test through this run's launcher and options"


class _Finished(PrefectTaskRunFuture):
    """A step that has finished, as a future for `wait_for`. Given a State, Prefect would also walk into its
    result and add an edge for every value some other task returned too (an interned "no" in two results
    linked unrelated steps); a future is taken as exactly one edge."""

    def __init__(self, state) -> None:
        super().__init__(state.state_details.task_run_id)
        self._final_state = state

    def wait(self, timeout: float | None = None) -> None:
        return None

    def result(self, timeout: float | None = None, raise_on_failure: bool = True) -> Any:
        return self._final_state.result(raise_on_failure=raise_on_failure)

    def add_done_callback(self, fn) -> None:
        fn(self)


class _Runner:
    """Runs step tasks in DAG order, records the DAG's edges in Prefect, and keeps the summary rows."""

    def __init__(self, request: PipelineRequest) -> None:
        self.request = request
        self.graph = build_graph(request, with_status=False)
        self.enabled = {s.name for s in self.graph.steps if s.enabled}
        self.states: dict[str, Any] = {}
        self.outcomes: dict[str, StepOutcome] = {}
        self.results: dict[str, Any] = {}
        self.failed: tuple[str, str, int] | None = None  # step, message, exit code

    def waits_for(self, name: str) -> list[Any]:
        """The steps `name` follows in the DAG, as futures: Prefect records exactly these as its edges."""
        return [_Finished(self.states[step]) for step in upstream(name, self.enabled) if step in self.states]

    def _call(self, name: str, *extra: Any, submit: bool = False):
        step = self.graph.step(name)
        task = _TASKS[name].with_options(refresh_cache=self.request.forced(name))
        # quoted: Prefect would otherwise add an edge for every argument that is some task's result
        args = (quote(self.request), *(quote(value) for value in extra))
        kwargs = dict(key=step.key or f"pa-{name}-unkeyed", wait_for=self.waits_for(name))
        started = time.monotonic()
        if submit:
            return task.submit(*args, **kwargs), started
        return task(*args, **kwargs, return_state=True), started

    def finish(self, name: str, state, started: float) -> bool:
        duration = round(time.monotonic() - started, 2)
        self.states[name] = state
        if state.is_completed():
            self.results[name] = state.result()
            cached = state.name == "Cached"
            step = self.graph.step(name)
            if step.key:
                index.record(self.graph.pipeline_id, name, step.key, step.inputs)
            reason = "inputs unchanged" if cached else step.reason or ""
            if name == "config":  # an old-format config is worth seeing in the summary, not only in the task log
                notes = getattr(self.results[name], "notes", None) or []
                migrated = [note for note in notes if "older format" in note]
                if migrated:
                    reason = f"{reason}; {migrated[0]}" if reason else migrated[0]
            if name == "memory-fit":
                reason = artifacts.fit_summary(self.results[name]) + ("; from the cache" if cached else "")
            self.outcomes[name] = StepOutcome(step=name, status="cached" if cached else "ran", duration_s=duration, reason=reason)
            self._publish(name, state, cached)
            return True
        error = state.result(raise_on_failure=False)
        text = failure_text(error) if isinstance(error, BaseException) else str(state.message or state.name)
        self.outcomes[name] = StepOutcome(step=name, status="failed", duration_s=duration, reason=text)
        self.failed = (name, text, failure_exit_code(error))
        return False

    def _publish(self, name: str, state, cached: bool) -> None:
        """The step's artifact, under its task run: a cached step's too, so each run shows all that gated it."""
        markdown, description = _step_artifact(name, self.results[name])
        if cached:
            description += " (from the cache: inputs unchanged since it ran)"
        artifacts.publish(naming.artifact_key(STEP_ARTIFACTS[name], self.request), markdown=markdown, description=description,
                          task_run_id=state.state_details.task_run_id)

    def run(self, name: str, *extra: Any) -> bool:
        if self.failed or name not in self.enabled:
            return self.failed is None
        state, started = self._call(name, *extra)
        return self.finish(name, state, started)

    def last_state(self):
        """The state of the last preflight step that ran: the launch waits for it."""
        return next((self.states[name] for name in reversed(PREFLIGHT_STEPS) if name in self.states), None)

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
        return PreflightReport(ok=ok, steps=rows, failed_step=self.failed[0] if self.failed else None, message=message,
                               exit_code=self.failed[2] if self.failed else 0, results=data)


def summary_rows(report: PreflightReport, graph=None) -> list[dict[str, Any]]:
    """The summary table: each step, what it waited for, run/cached/skipped/failed, its time and why."""
    after = {s.name: ", ".join(s.depends_on) or "-" for s in graph.steps} if graph is not None else {}
    return [
        {"step": s.step, "after": after.get(s.step, "") if s.status != "skipped" else "-", "status": s.status,
         "seconds": s.duration_s if s.duration_s is not None else "", "why": s.reason if s.status != "failed" else "see the error above"}
        for s in report.steps
    ]


def _run_preflight(request: PipelineRequest) -> tuple[PreflightReport, _Runner]:
    runner = _Runner(request)
    if runner.run("config"):
        pending = [(name, runner._call(name, submit=True)) for name in ("env", "memory") if name in runner.enabled]
        for name, (future, started) in pending:  # in parallel; both finish
            future.wait()
            runner.finish(name, future.state, started)
        estimate = runner.results.get("memory")
        if estimate is not None:
            runner.run("memory-fit", estimate)
        runner.run("deepspeed-check", estimate)
        runner.run("install-test")
    return runner.report(), runner


def run_preflight(request: PipelineRequest) -> PreflightReport:
    """The preflight DAG (must be called inside a flow). Never raises for a failed step; see `report.ok`."""
    return _run_preflight(request)[0]


def _log_steps(report: PreflightReport) -> None:
    logger = get_run_logger()
    for step in report.steps:  # the failed step's reason is the run's one error message, not repeated here
        logger.info("%-16s %-8s %s", step.step, step.status, step.reason if step.status != "failed" else "")


def _summary(key_kind: str, request: PipelineRequest, runner: _Runner, report: PreflightReport, launch_row=None, outcome: str = "") -> None:
    rows = summary_rows(report, runner.graph)
    if launch_row is not None:
        rows.append(launch_row)
    artifacts.publish(naming.artifact_key(key_kind, request), table=rows, description=outcome or report.message)


def _failed(message: str, exit_code: int = 1):
    """The run's final state for an expected failure: the message once, no traceback, no stored exception
    (a persisted exception would also show as an unnamed result artifact). Callers of the flow function still
    get the PreflightError raised."""
    return Failed(message=message, data=PreflightError(message, exit_code=exit_code))


@flow(name="pipeline-plan", flow_run_name=_run_name("plan"))
def publish_plan(request: PipelineRequest) -> list[dict[str, str]]:
    """`plan --track`: the plan as a table artifact (each step, what it waits for, would run / use cache / not
    needed, and why); runs none of the steps."""
    from prefect_accelerate.pipeline.graph import build_graph, plan_rows

    graph = build_graph(request)
    rows = plan_rows(graph)
    description = f"What `pipeline` would do now{': ' + graph.error if graph.error else ''}"
    artifacts.publish(naming.artifact_key(PLAN_ARTIFACT, request), table=rows, description=description)
    return rows


@flow(name="preflight", flow_run_name=_run_name("preflight"), on_cancellation=[end_launch_processes], on_crashed=[end_launch_processes])
def preflight(request: PipelineRequest) -> PreflightReport:
    """Check everything a launch needs, reusing cached steps; fails naming the failed step (PreflightError)."""
    report, runner = _run_preflight(request)
    _log_steps(report)
    _summary(SUMMARY_ARTIFACT, request, runner, report)
    if not report.ok:
        return _failed(report.message, report.exit_code)
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


#: how often a paused launch asks the server whether it was approved: the launch starts within this of the click
#: (Prefect's default, 10 s, is a long wait in front of a button; one small read every 2 s is cheap)
APPROVAL_POLL_SECONDS = 2


def ask_for_approval(request: PipelineRequest, report: PreflightReport, plan_json: dict[str, Any], timeout: int = 3600) -> bool:
    from prefect.flow_runs import pause_flow_run
    from prefect.input import RunInput

    class LaunchApproval(RunInput):
        approve: bool = False
        note: str = ""

    answer = pause_flow_run(
        wait_for_input=LaunchApproval.with_initial_data(description=approval_description(request, report, plan_json), approve=False),
        timeout=timeout,
        poll_interval=APPROVAL_POLL_SECONDS,
    )
    if answer.note:
        get_run_logger().info("Approval note: %s", answer.note)
    return bool(answer.approve)


@flow(name="launch-training", flow_run_name=_run_name("launch-training"), on_cancellation=[end_launch_processes], on_crashed=[end_launch_processes])
def launch_training(request: PipelineRequest) -> PipelineResult:
    """Preflight, then (after approval, when asked for) the training launch in this flow's main thread."""
    from prefect_accelerate.launchers import plan_launch
    from prefect_accelerate.tasks.launch import RESULT_ARTIFACT_KEY, launch

    logger = get_run_logger()
    report, runner = _run_preflight(request)
    _log_steps(report)
    last = next((name for name in reversed(PREFLIGHT_STEPS) if name in runner.states), "-")

    def summary(status: str, why: str, seconds: Any = "") -> None:
        row = {"step": "launch", "after": last + (", approval" if request.require_approval else ""), "status": status,
               "seconds": seconds, "why": why}
        _summary(PIPELINE_ARTIFACT, request, runner, report, row, outcome=f"{report.message} Launch: {why}")

    if not report.ok:
        summary("skipped", "not started: a preflight step failed")
        return _failed(report.message + " Nothing was launched.", report.exit_code)
    options = launch_options(request)
    plan = plan_launch(options, cwd=request.cwd)
    approved = None
    if request.require_approval:
        approved = ask_for_approval(request, report, plan.to_json_dict())
        if not approved:
            logger.warning("The launch was not approved; nothing was started.")
            summary("skipped", "not approved")
            return PipelineResult(preflight=report, launched=False, approved=False)
    # quoted: the launch's only edge is the DAG's (the last preflight step), not its arguments
    state = launch(options=quote(options), plan=quote(plan), result_key=naming.artifact_key(RESULT_ARTIFACT_KEY, request), return_state=True,
                   wait_for=[_Finished(s) for s in [runner.last_state()] if s is not None])
    if not state.is_completed():
        error = state.result(raise_on_failure=False)
        text = failure_text(error) if isinstance(error, BaseException) else str(state.message)
        summary("failed", "the training failed; see the launch-result artifact")
        if isinstance(error, PrefectAccelerateError):  # the task already logged it; the flow's state carries it
            return Failed(message=text, data=error)
        if isinstance(error, BaseException):
            raise error
        return Failed(message=text)
    result = state.result()
    summary("ran", f"succeeded: exit code {result.exit_code} in {result.duration_s:.1f} s", result.duration_s)
    return PipelineResult(preflight=report, launched=True, approved=approved, launch=result)
