"""Carry out a LaunchPlan: local plans go to the process supervisor, remote engines to their own runner.

An engine module whose launches are not local processes (SageMaker jobs) defines
`run(plan, *, on_line, timeout, grace, flow_run_id, task_run_id) -> LaunchResult`; it is used for
plans whose `launcher` is listed in REMOTE_RUNNERS.
"""

from __future__ import annotations

import importlib

from prefect_accelerate.launchers.plan import LaunchPlan
from prefect_accelerate.launchers.process import GRACE_SECONDS, LineCallback, run_plan
from prefect_accelerate.launchers.result import LaunchResult

#: plan.launcher -> module with a `run` function
REMOTE_RUNNERS: dict[str, str] = {
    "sagemaker": "prefect_accelerate.launchers.sagemaker",
    "slurm": "prefect_accelerate.launchers.engines.slurm",
}


def execute(
    plan: LaunchPlan,
    *,
    on_line: LineCallback | None = None,
    timeout: float | None = None,
    grace: float = GRACE_SECONDS,
    flow_run_id: str | None = None,
    task_run_id: str | None = None,
) -> LaunchResult:
    """Run `plan` to completion (or deadline) and return its result; interrupts stop it and re-raise."""
    module = REMOTE_RUNNERS.get(plan.launcher)
    runner = importlib.import_module(module).run if module else run_plan
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
