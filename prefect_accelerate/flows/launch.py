"""`launch_flow`: one launch as a flow run, with the hook that ends orphaned processes.

`end_launch_processes` is the shipped on_cancellation/on_crashed hook: it reads the state files of
this flow run's launches and ends every process still alive (launchers/state.py). Add it to your own
flows that call the `launch` task.
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from prefect_accelerate.launchers.options import LaunchOptions
from prefect_accelerate.launchers.plan import LaunchPlan
from prefect_accelerate.launchers.result import LaunchResult
from prefect_accelerate.launchers.state import end_recorded_launches
from prefect_accelerate.tasks.launch import launch


def end_launch_processes(flow, flow_run, state) -> None:  # noqa: ARG001 - Prefect's hook signature
    """Hook: end whatever the launches of this flow run left behind (idempotent): local processes, remote jobs."""
    from prefect_accelerate.launchers.engines import ENGINES

    found: list[tuple[str, list[str]]] = [("leftover launch process(es)", end_recorded_launches(str(flow_run.id)))]
    for engine in ENGINES.values():
        if engine.stop_recorded is None:
            continue
        try:
            found.append((f"{engine.job_noun}(s)", engine.stopper()(str(flow_run.id))))
        except Exception as error:  # a hook must not fail the others; say why the job may still run
            print(f"prefect-accelerate: could not stop the recorded {engine.job_noun}s: {error}")
    for what, items in found:
        if not items:
            continue
        try:
            get_run_logger().warning("Ended %d %s: %s", len(items), what, items)
        except Exception:
            print(f"prefect-accelerate: ended {what} {items}")


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    params = flow_run.parameters
    plan = params.get("plan")
    options = params.get("options")
    script = getattr(options, "training_script", None) or (plan.argv[-1] if plan else "script")
    launcher = plan.launcher if plan else "launch"
    return f"launch-{launcher}-{script.rsplit('/', 1)[-1]}"


@flow(name="launch", flow_run_name=_flow_run_name, on_cancellation=[end_launch_processes], on_crashed=[end_launch_processes])
def launch_flow(options: LaunchOptions | None = None, plan: LaunchPlan | None = None) -> LaunchResult:
    """Run one launch as a Prefect flow (what `prefect-accelerate launch` does when tracked).

    A launch stopped at its deadline (`--timeout`) ends the flow run Cancelled, with the reason, rather than
    Failed: the training did not fail, it was stopped as asked. The caller still gets the LaunchError
    (exit code 124), as from an untracked launch.
    """
    from prefect.states import Cancelled

    from prefect_accelerate.errors import LaunchError

    try:
        return launch(options=options, plan=plan)
    except LaunchError as error:
        result = getattr(error, "result", None)
        if result is None or not result.timed_out:
            raise
        return Cancelled(message=f"Stopped by its deadline (--timeout) after {result.duration_s:.1f} s; every process "
                         "the launch started was ended.", data=error)
