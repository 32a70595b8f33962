"""Carry out a LaunchPlan: local plans go to the process supervisor, remote engines to their own runner.

Which is which is the engine table's business (launchers/engines/__init__.py): a plan whose `launcher`
names a remote engine (SageMaker) goes to that engine's `run`, every other plan to `run_plan`. A local plan
already started (`start_plan`, as the tracked CLI does before its Prefect run exists) is waited on instead.
"""

from __future__ import annotations

from prefect_accelerate.launchers.engines import runner_for
from prefect_accelerate.launchers.plan import LaunchPlan
from prefect_accelerate.launchers.process import GRACE_SECONDS, LaunchHandle, LineCallback
from prefect_accelerate.launchers.result import LaunchResult


def execute(
    plan: LaunchPlan,
    *,
    on_line: LineCallback | None = None,
    timeout: float | None = None,
    grace: float = GRACE_SECONDS,
    flow_run_id: str | None = None,
    task_run_id: str | None = None,
    started: LaunchHandle | None = None,
) -> LaunchResult:
    """Run `plan` to completion (or deadline) and return its result; interrupts stop it and re-raise.

    `started`: this plan, already running; it is adopted (its state file names the runs from now on) and
    supervised from here, and its lines keep going where they went (`on_line` is not used for it).
    """
    runner = runner_for(plan)
    if started is not None:
        started.record_run(flow_run_id, task_run_id)
        result = started.wait(timeout=timeout, grace=grace)
        on_line = started.on_line  # a retry's lines go where the first attempt's went
    else:
        result = runner(plan, on_line=on_line, timeout=timeout, grace=grace, flow_run_id=flow_run_id, task_run_id=task_run_id)
    if not result.succeeded and plan.implicit_port and _lost_port_race(result):
        # the default port was free when planned and taken before torchrun bound it: one retry on a free port
        retry = _with_free_port(plan)
        if on_line is not None:
            on_line(plan.launcher, f"[prefect-accelerate] port {_port(plan)} was taken meanwhile; retrying on port {_port(retry)}")
        result = runner(retry, on_line=on_line, timeout=timeout, grace=grace, flow_run_id=flow_run_id, task_run_id=task_run_id)
    return result


def _lost_port_race(result: LaunchResult) -> bool:
    return any("EADDRINUSE" in line or "address already in use" in line for line in result.tail)


def _port(plan: LaunchPlan) -> str:
    return plan.argv[plan.argv.index("--master_port") + 1]


def _with_free_port(plan: LaunchPlan) -> LaunchPlan:
    from prefect_accelerate.launchers.host import local_host

    argv = list(plan.argv)
    argv[argv.index("--master_port") + 1] = str(local_host().free_port())
    return plan.model_copy(update={"argv": tuple(argv), "implicit_port": False})
