"""`tpu_config_flow`: `tpu-config` as a flow run (what the CLI runs when tracked).

The launch hook ends a gcloud that a cancelled or crashed run left behind (launchers/state.py).
"""

from __future__ import annotations

from prefect import flow

from prefect_accelerate.flows.launch import end_launch_processes
from prefect_accelerate.tasks.tpu import tpu_config
from prefect_accelerate.tpu_config import TpuConfigRequest, TpuConfigResult


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    request = flow_run.parameters.get("request")
    return f"tpu-config-{request.pod.name if request is not None else 'pod'}"


@flow(name="tpu-config", flow_run_name=_flow_run_name, on_cancellation=[end_launch_processes], on_crashed=[end_launch_processes])
def tpu_config_flow(request: TpuConfigRequest, timeout: float | None = None) -> TpuConfigResult:
    """Run one `tpu-config` request as a Prefect flow."""
    return tpu_config(request, timeout=timeout)
