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
    return runner(plan, on_line=on_line, timeout=timeout, grace=grace, flow_run_id=flow_run_id, task_run_id=task_run_id)
