"""The parent's view of its node runs, through Prefect's API: queues, the rendezvous port, states, stopping.

The parent and its node runs meet through two table artifacts on each node's run: rank 0 publishes
where the others connect (RENDEZVOUS_KEY) before it launches, and every node publishes how its launch
ended (NODE_RESULT_KEY). Everything here takes a synchronous Prefect client (`api_client()`).
"""

from __future__ import annotations

import json
import time
from typing import Any

from prefect_accelerate.errors import LaunchError
from prefect_accelerate.flows.multinode_requests import MultinodeRequest, NodeOutcome
from prefect_accelerate.launchers.result import LaunchResult

#: artifact keys: rank 0's address and port, and each node's result
#: artifact keys: rank 0's address and port, and each node's result
RENDEZVOUS_KEY = "node-rendezvous"
NODE_RESULT_KEY = "node-launch-result"


def api_client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def read_runs(client, ids: list[str]) -> dict[str, Any]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    if not ids:
        return {}
    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)), limit=len(ids))
    return {str(run.id): run for run in runs}


def _table(client, flow_run_id: str, key: str) -> list[dict[str, Any]]:
    """The rows of a table artifact `key` of one flow run (empty when it has none yet)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    found = client.read_artifacts(
        artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
    )
    for artifact in found:
        data = artifact.data
        rows = json.loads(data) if isinstance(data, str) else data
        if isinstance(rows, list) and rows:
            return rows
    return []


def cancel_runs(client, ids: list[str], reason: str) -> list[str]:
    """Ask every run in `ids` that has not finished to cancel (idempotent). Returns the ids asked."""
    from prefect.states import Cancelling

    asked = []
    for run_id, run in read_runs(client, ids).items():
        if run.state is None or run.state.is_final() or run.state.is_cancelling():
            continue
        try:
            # Cancelling, never Cancelled: the run's worker stops its process (a run that no worker
            # has started yet goes straight to Cancelled on the server)
            client.set_flow_run_state(run_id, Cancelling(message=reason))
            asked.append(run_id)
        except Exception:  # a run that just finished refuses the transition; nothing to stop then
            continue
    return asked


def child_run_ids(client, parent_id: str) -> list[str]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])))
    return [str(run.id) for run in runs]


def ensure_queues(client, request: MultinodeRequest, pool: str | None) -> list[str]:
    """Create the per-node work queues that do not exist yet; returns their names.

    A worker started with `--work-queue NAME` for a queue that does not exist polls nothing and says
    nothing (Prefect 3.9 treats the not-found answer as "no runs"); once the queue exists, its next
    poll finds the runs. So a missing queue is created here rather than left to wait for start_timeout.
    """
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    created = []
    for rank in range(request.num_machines):
        name = request.queue(rank)
        try:
            client.read_work_queue_by_name(name, work_pool_name=pool)
        except ObjectNotFound:
            try:
                client.create_work_queue(name, description=f"prefect-accelerate: machine {rank}'s node launches", work_pool_name=pool)
                created.append(name)
            except ObjectAlreadyExists:  # another launch made it meanwhile
                pass
    return created


def not_started_message(request: MultinodeRequest, rank: int, pool: str | None) -> str:
    queue = request.queue(rank)
    return (
        f"Machine {rank}'s node run did not start within {request.start_timeout:.0f} s: no worker took it from work queue "
        f"{queue!r}. Start one on that machine: prefect worker start --pool {pool or '<pool>'} --work-queue {queue}"
    )


def wait_for_port(client, request: MultinodeRequest, run_id: str, pool: str | None) -> int:
    deadline = time.monotonic() + request.start_timeout
    while True:
        rows = _table(client, run_id, RENDEZVOUS_KEY)
        if rows:
            return int(rows[0]["main_process_port"])
        run = client.read_flow_run(run_id)
        if run.state is not None and run.state.is_final():
            raise LaunchError(
                f"Machine 0's node run ended {run.state.name} before it published its port: {run.state.message or 'no message'}"
            )
        if time.monotonic() > deadline:
            raise LaunchError(not_started_message(request, 0, pool))
        time.sleep(min(request.poll_interval, 1.0))


def node_outcome(client, request: MultinodeRequest, rank: int, run) -> NodeOutcome:
    state = run.state
    rows = _table(client, str(run.id), NODE_RESULT_KEY)
    row = rows[0] if rows else {}
    launch = None
    if "launcher" in row and "command" in row:
        launch = LaunchResult.model_validate({k: v for k, v in row.items() if k in LaunchResult.model_fields})
    return NodeOutcome(
        rank=rank, work_queue=request.queue(rank), flow_run_id=str(run.id), flow_run_name=run.name,
        state=state.name if state else "Unknown", message=(state.message or "") if state else "",
        exit_code=row.get("exit_code"), host=row.get("host"), launch=launch,
    )


def settle_placeholders(client, runs: dict[str, Any]) -> None:
    """run_deployment adds a Pending task run to the parent per node; give it the node's final state."""
    from prefect.states import Cancelled, Completed, Failed

    for run in runs.values():
        if run.parent_task_run_id is None or run.state is None or not run.state.is_final():
            continue
        state = Completed() if run.state.is_completed() else Cancelled() if run.state.is_cancelled() else Failed(message=run.state.message)
        try:
            client.set_task_run_state(run.parent_task_run_id, state, force=True)
        except Exception:
            pass
