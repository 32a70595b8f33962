"""The `launch` task: run a LaunchPlan with its output in the run logger and a result artifact.

Call it from the flow's main thread (never `.submit()`): Prefect delivers cancellation there, and the
process supervisor needs it to stop the training processes (DESIGN.md §4). Never cached, no retries.

A launch the CLI started before this run existed (`taking_over`) is adopted rather than started again: the
task records its run ids in the launch's state file (so the flow's hooks can end it), ships the lines printed
so far to the run's logs in order, with their rank labels and the times they were printed, and supervises
it to the end from here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import TerminationSignal

from prefect_accelerate.errors import Terminated
from prefect_accelerate.launchers import plan_launch
from prefect_accelerate.launchers.options import LaunchOptions
from prefect_accelerate.launchers.plan import LaunchPlan
from prefect_accelerate.launchers.execute import execute
from prefect_accelerate.launchers.linebuffer import LineBuffer, TimedLineCallback
from prefect_accelerate.launchers.process import GRACE_SECONDS, LaunchHandle
from prefect_accelerate.launchers.result import LaunchResult

RESULT_ARTIFACT_KEY = "launch-result"

#: how the last launch of this process ended, read by the CLI when its Prefect server went away mid-launch
#: ("started", then "result": the LaunchResult, or "interrupted": 130 / 143); the training's outcome must not
#: depend on the server
LAST_OUTCOME: dict[str, object] = {}

#: launches started before their Prefect run existed, each waiting for the launch task of its plan
_STARTED_EARLY: list[tuple[LaunchHandle, LineBuffer]] = []


@contextlib.contextmanager
def taking_over(handle: LaunchHandle, lines: LineBuffer) -> Iterator[None]:
    """While inside, the launch task of `handle.plan` adopts `handle` instead of starting the plan; `lines` holds
    the output printed so far (the console has it already) and is attached to the run's logs."""
    entry = (handle, lines)
    _STARTED_EARLY.append(entry)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            _STARTED_EARLY.remove(entry)


def _started_early(plan: LaunchPlan) -> tuple[LaunchHandle, LineBuffer] | None:
    for entry in _STARTED_EARLY:
        if entry[0].plan == plan:
            _STARTED_EARLY.remove(entry)
            return entry
    return None


def _to_run_logs(logger: logging.LoggerAdapter) -> TimedLineCallback:
    """Lines to this run's logs in Prefect only, each with the time it was printed: the console printed them
    when they came. (The run logger would print them again, through the console handler Prefect adds.)"""
    from prefect.logging.handlers import APILogHandler

    base = logger.logger
    handlers = []
    current: logging.Logger | None = base
    while current is not None:  # the API handlers a record of `base` reaches, as Logger.callHandlers walks them
        handlers += [h for h in current.handlers if isinstance(h, APILogHandler)]
        current = current.parent if current.propagate else None

    def ship(created: float, label: str, line: str) -> None:
        _, kwargs = logger.process("", {})
        record = base.makeRecord(base.name, logging.INFO, __file__, 0, "[%s] %s", (label, line), None, extra=kwargs.get("extra"))
        record.created, record.msecs = created, (created - int(created)) * 1000
        for handler in handlers:
            if record.levelno >= handler.level:
                handler.handle(record)

    return ship


def _launch_run_name() -> str:
    from prefect.runtime import task_run

    params = task_run.parameters
    plan = params.get("plan")
    if hasattr(plan, "unquote"):  # the pipeline quotes its arguments (prefect.utilities.annotations.quote)
        plan = plan.unquote()
    if plan is not None:
        return f"launch-{plan.launcher}-{plan.num_machines}x{max(plan.num_processes // max(plan.num_machines, 1), 1)}"
    return "launch"


def _wrapped_command(command: str) -> list[str]:
    """The command one option per line (shell continuations), so that nothing is cut off at the UI's edge."""
    import shlex

    try:
        words = shlex.split(command)
    except ValueError:
        return [command]
    lines: list[str] = []
    for word in words:
        takes_value = bool(lines) and lines[-1].startswith("-") and " " not in lines[-1] and "=" not in lines[-1]
        if lines and not word.startswith("-") and takes_value:
            lines[-1] += " " + shlex.quote(word)
        else:
            lines.append(shlex.quote(word))
    return [line + " \\" for line in lines[:-1]] + lines[-1:]


def result_markdown(plan: LaunchPlan, result: LaunchResult) -> str:
    """The launch as a person reads it in the UI: the outcome first, the layout, the command, the last output."""
    if result.succeeded:
        status, outcome = "succeeded", f"succeeded: exit code 0 after {result.duration_s:.1f} s"
    elif result.timed_out:
        status, outcome = "timed out", f"stopped at its deadline after {result.duration_s:.1f} s"
    else:
        status, outcome = "failed", f"failed: exit code {result.exit_code} after {result.duration_s:.1f} s"
    layout = f"{plan.num_processes} process(es) on {plan.num_machines} machine(s)"
    if plan.num_machines > 1:
        layout += f"; this launch is machine {plan.machine_rank}"
    lines = [f"## Training {status}", "", "| item | value |", "|---|---|", f"| outcome | {outcome} |",
             f"| launcher | {plan.launcher} |", f"| layout | {layout} |"]
    if result.failed_ranks:
        lines.append("| failed ranks | " + ", ".join(f"rank {f.rank} (exit code {f.exit_code})" for f in result.failed_ranks) + " |")
    job = getattr(result, "job", None)
    if job is not None:  # a SageMaker job rather than local processes
        lines += [f"| job {k} | {v} |" for k, v in job.model_dump(mode="json").items() if v not in (None, "")]
    if result.error:
        lines += ["", f"**Error:** {result.error}"]
    if result.tail:
        lines += ["", "Last output lines (every line is in this run's logs):", "```", *result.tail[-15:], "```"]
    lines += ["", "Command:", "```", *_wrapped_command(result.command), "```"]
    if result.log_path:
        lines += ["", f"The full output is also kept on the launching machine, in {result.log_path}."]
    return "\n".join(lines)


@task(name="launch", task_run_name=_launch_run_name, retries=0, cache_policy=NO_CACHE, persist_result=False)
def launch(
    options: LaunchOptions | None = None,
    plan: LaunchPlan | None = None,
    timeout: float | None = None,
    grace_period: float | None = None,
    result_key: str = RESULT_ARTIFACT_KEY,
) -> LaunchResult:
    """Run a training launch and wait for it; raises LaunchError when it fails.

    Args:
        options: merged launch options (`build_launch_options(...)`); planned here when `plan` is None.
        plan: an already made plan (what `--dry-run` showed).
        timeout: deadline in seconds (default: options.timeout).
        grace_period: SIGTERM-to-SIGKILL seconds (default: options.grace_period, else 20).
        result_key: the result artifact's key (a pipeline gives its own, so its history is that pipeline's).

    Returns:
        The LaunchResult of a successful launch.
    """
    from prefect.runtime import flow_run, task_run

    logger = get_run_logger()
    if options is None and plan is None:
        raise ValueError("launch needs options or a plan")
    if plan is None:
        plan = plan_launch(options)
    if threading.current_thread() is not threading.main_thread():
        logger.warning(
            "The launch task is running outside the flow's main thread (was it .submit()-ted?). Prefect cannot deliver "
            "cancellation here; the flow's on_cancellation hook will end the processes instead."
        )
    for note in plan.notes:
        logger.info(note)
    for warning in plan.warnings:
        logger.warning(warning)
    early = _started_early(plan)
    if early is not None:
        logger.info("Launching: %s (started before this run existed; its first lines are logged with the times they were printed)", plan.command_line())
    else:
        logger.info("Launching: %s", plan.command_line())
    env = plan.redacted_env()
    if env:
        logger.info("Environment added for the launch: %s", " ".join(f"{k}={v}" for k, v in sorted(env.items())))

    def log_line(label: str, line: str) -> None:
        logger.info("[%s] %s", label, line)

    LAST_OUTCOME.clear()
    LAST_OUTCOME["started"] = True
    if early is not None:
        early[1].attach(_to_run_logs(logger))
    try:
        result = execute(
            plan,
            on_line=log_line,
            timeout=timeout if timeout is not None else (options.timeout if options is not None else None),
            grace=grace_period if grace_period is not None else (options.grace_period if options is not None else GRACE_SECONDS),
            flow_run_id=str(flow_run.id) if flow_run.id else None,
            task_run_id=str(task_run.id) if task_run.id else None,
            started=early[0] if early is not None else None,
        )
    except KeyboardInterrupt:
        LAST_OUTCOME["interrupted"] = 130
        raise
    except (TerminationSignal, Terminated):
        LAST_OUTCOME["interrupted"] = 143
        raise
    LAST_OUTCOME["result"] = result
    create_markdown_artifact(key=result_key, markdown=result_markdown(plan, result), description=f"Training {'succeeded' if result.succeeded else 'failed'}: {plan.launcher}, {plan.num_processes} process(es)")
    return result.raise_for_failure()
