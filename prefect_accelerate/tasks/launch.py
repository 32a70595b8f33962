"""The `launch` task: run a LaunchPlan with its output in the run logger and a result artifact.

Call it from the flow's main thread (never `.submit()`): Prefect delivers cancellation there, and the
process supervisor needs it to stop the training processes (DESIGN.md §4). Never cached, no retries.
"""

from __future__ import annotations

import threading

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import TerminationSignal

from prefect_accelerate.errors import Terminated
from prefect_accelerate.launchers import plan_launch
from prefect_accelerate.launchers.options import LaunchOptions
from prefect_accelerate.launchers.plan import LaunchPlan
from prefect_accelerate.launchers.execute import execute
from prefect_accelerate.launchers.process import GRACE_SECONDS
from prefect_accelerate.launchers.result import LaunchResult

RESULT_ARTIFACT_KEY = "launch-result"

#: how the last launch of this process ended, read by the CLI when its Prefect server went away mid-launch
#: ("started", then "result": the LaunchResult, or "interrupted": 130 / 143); the training's outcome must not
#: depend on the server
LAST_OUTCOME: dict[str, object] = {}


def _launch_run_name() -> str:
    from prefect.runtime import task_run

    params = task_run.parameters
    plan = params.get("plan")
    if plan is not None:
        return f"launch-{plan.launcher}-{plan.num_machines}x{max(plan.num_processes // max(plan.num_machines, 1), 1)}"
    return "launch"


def result_markdown(plan: LaunchPlan, result: LaunchResult) -> str:
    status = "succeeded" if result.succeeded else ("timed out" if result.timed_out else "failed")
    lines = [
        f"# Launch {status}",
        "",
        "| | |",
        "|---|---|",
        f"| launcher | `{plan.launcher}` |",
        f"| processes | {plan.num_processes} on {plan.num_machines} machine(s), this is rank {plan.machine_rank} |",
        f"| exit code | {result.exit_code} |",
        f"| duration | {result.duration_s:.1f} s |",
        f"| log | `{result.log_path}` |",
        "",
        "```",
        result.command,
        "```",
    ]
    job = getattr(result, "job", None)
    if job is not None:  # a SageMaker job rather than local processes
        lines += ["", "| job | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in job.model_dump(mode="json").items() if v not in (None, "")]
    if result.failed_ranks:
        lines += ["", "| failed rank | exit code |", "|---|---|"] + [f"| {f.rank} | {f.exit_code} |" for f in result.failed_ranks]
    if result.error:
        lines += ["", f"**Error:** {result.error}"]
    if not result.succeeded and result.tail:
        lines += ["", "Last lines:", "```", *result.tail[-20:], "```"]
    return "\n".join(lines)


@task(name="launch", task_run_name=_launch_run_name, retries=0, cache_policy=NO_CACHE, persist_result=False)
def launch(
    options: LaunchOptions | None = None,
    plan: LaunchPlan | None = None,
    timeout: float | None = None,
    grace_period: float | None = None,
) -> LaunchResult:
    """Run a training launch and wait for it; raises LaunchError when it fails.

    Args:
        options: merged launch options (`build_launch_options(...)`); planned here when `plan` is None.
        plan: an already made plan (what `--dry-run` showed).
        timeout: deadline in seconds (default: options.timeout).
        grace_period: SIGTERM-to-SIGKILL seconds (default: options.grace_period, else 20).

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
    logger.info("Launching: %s", plan.command_line())
    env = plan.redacted_env()
    if env:
        logger.info("Environment added for the launch: %s", " ".join(f"{k}={v}" for k, v in sorted(env.items())))

    def log_line(label: str, line: str) -> None:
        logger.info("[%s] %s", label, line)

    LAST_OUTCOME.clear()
    LAST_OUTCOME["started"] = True
    try:
        result = execute(
            plan,
            on_line=log_line,
            timeout=timeout if timeout is not None else (options.timeout if options is not None else None),
            grace=grace_period if grace_period is not None else (options.grace_period if options is not None else GRACE_SECONDS),
            flow_run_id=str(flow_run.id) if flow_run.id else None,
            task_run_id=str(task_run.id) if task_run.id else None,
        )
    except KeyboardInterrupt:
        LAST_OUTCOME["interrupted"] = 130
        raise
    except (TerminationSignal, Terminated):
        LAST_OUTCOME["interrupted"] = 143
        raise
    LAST_OUTCOME["result"] = result
    create_markdown_artifact(key=RESULT_ARTIFACT_KEY, markdown=result_markdown(plan, result), description="prefect-accelerate launch result")
    return result.raise_for_failure()
