"""Multi-node launches through Prefect work pools: one `node_launch` flow run per machine.

`multinode_launch` is the parent. It starts one run of the per-node deployment (`node-launch/per-node`
in deployments/prefect.yaml) per machine with `run_deployment(..., work_queue_name=..., timeout=0)`,
each on that machine's work queue (one process worker per machine polls it), passes the node's rank
and the main address and port, and watches them. If one node fails, or the parent is cancelled or
crashes, it sets every other node run to Cancelling; their workers then stop the training processes
(the `launch` task's supervisor, and `end_launch_processes` as the hook).

Port 0 means "pick a free port on the main machine". Only the rank-0 node can know which ports are
free there, so the parent starts rank 0 first; rank 0 picks a port, publishes it as a
`node-rendezvous` table artifact on its own run and launches; the parent reads the artifact and only
then starts the other nodes with that port.

Nothing here is retried: a launch is never retried by default (DESIGN.md §4).

This module is the deployments' entrypoint (deployments/prefect.yaml names it); the request and result
models are in multinode_requests.py, the parent's reading and cancelling of node runs in node_runs.py.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from pydantic import BaseModel

from prefect_accelerate.errors import LaunchError
from prefect_accelerate.flows.launch import end_launch_processes
from prefect_accelerate.flows.multinode_requests import (
    NODE_DEPLOYMENT,
    TOPOLOGY_FLAGS,
    MultinodeRequest,
    MultinodeResult,
    NodeLaunchRequest,
    NodeOutcome,
    node_options,
    node_queue_name,
    node_run_name,
)
from prefect_accelerate.flows.node_runs import (
    NODE_RESULT_KEY,
    RENDEZVOUS_KEY,
    api_client,
    cancel_runs,
    child_run_ids,
    ensure_queues,
    node_outcome,
    not_started_message,
    read_runs,
    settle_placeholders,
    wait_for_port,
)
from prefect_accelerate.launchers.result import LaunchResult

#: artifact key of the parent's summary table
SUMMARY_KEY = "multinode-launch"
#: after asking the other nodes to cancel: their worker's 30 s kill grace plus our launch grace, and margin
CANCEL_WAIT_SECONDS = 90.0
_TAIL_IN_ARTIFACT = 10


def _param(params: dict[str, Any], name: str) -> Any:
    value = params.get(name)
    return value.model_dump() if isinstance(value, BaseModel) else (value or {})


def _node_flow_run_name() -> str:
    from prefect.runtime import flow_run

    request = _param(flow_run.parameters, "request")
    return node_run_name(int(request.get("machine_rank", 0)), int(request.get("num_machines", 1)))


def _multinode_flow_run_name() -> str:
    from prefect.runtime import flow_run

    request = _param(flow_run.parameters, "request")
    machines = int(request.get("num_machines", 1))
    processes = int((request.get("launch_flags") or {}).get("num_processes") or machines)
    script = Path(str(request.get("script", "script"))).stem
    return f"multinode-{script}-{machines}x{max(processes // max(machines, 1), 1)}"


def pick_free_port() -> int:
    """A TCP port free on every interface of this machine (torchrun's store listens on all of them), from below the
    kernel's ephemeral range (launchers/host.py, `rendezvous_port`)."""
    from prefect_accelerate.launchers.ports import rendezvous_port

    return rendezvous_port("")


def _publish_node_result(request: NodeLaunchRequest, result: LaunchResult | None, error: BaseException | None = None) -> None:
    from prefect.artifacts import create_table_artifact

    row: dict[str, Any] = {"rank": request.machine_rank, "host": socket.gethostname()}
    if result is not None:
        data = result.model_dump(mode="json")
        data["tail"] = data["tail"][-_TAIL_IN_ARTIFACT:]
        row.update(data)
    else:
        row.update(exit_code=getattr(error, "exit_code", 1), error=str(error))
    create_table_artifact(
        key=NODE_RESULT_KEY, table=[row], description=f"prefect-accelerate: machine {request.machine_rank} of {request.num_machines}"
    )


@flow(
    name="node-launch",
    flow_run_name=_node_flow_run_name,
    retries=0,
    persist_result=False,
    on_cancellation=[end_launch_processes],
    on_crashed=[end_launch_processes],
)
def node_launch(request: NodeLaunchRequest) -> LaunchResult:
    """One machine's share of a multi-node launch: plan here, then run the `launch` task in this flow's main thread.

    Rank 0 with `main_process_port=0` picks a free port on this machine and publishes it (artifact
    `node-rendezvous`) before launching, so the parent can pass it to the other machines.

    Raises:
        LaunchError: the training processes on this machine failed (the run ends Failed).
    """
    from prefect.artifacts import create_table_artifact

    from prefect_accelerate.launchers import plan_launch
    from prefect_accelerate.tasks.launch import launch

    logger = get_run_logger()
    port = request.main_process_port
    if port == 0:
        port = pick_free_port()
        logger.info("Picked free port %d on %s for the rendezvous.", port, socket.gethostname())
    if request.machine_rank == 0:
        create_table_artifact(
            key=RENDEZVOUS_KEY,
            table=[{"main_process_ip": request.main_process_ip, "main_process_port": port, "host": socket.gethostname()}],
            description="Where the other machines meet the main machine (rank 0).",
        )
    options = node_options(request, port)
    plan = plan_launch(options, cwd=request.cwd)
    logger.info("Machine %d of %d, rendezvous %s:%d.", request.machine_rank, request.num_machines, request.main_process_ip, port)
    try:
        result = launch(plan=plan, timeout=request.timeout, grace_period=options.grace_period)
    except LaunchError as error:
        _publish_node_result(request, getattr(error, "result", None), error)
        raise
    _publish_node_result(request, result)
    return result


# --- the parent --------------------------------------------------------------------------------------


def cancel_node_runs(flow, flow_run, state) -> None:  # noqa: ARG001 - Prefect's hook signature
    """Hook (parent cancelled or crashed): cancel the node runs it started.

    `run_deployment` records each node run as a subflow of the parent, so the hook finds them through
    the API; it may run in the parent's process or in its worker, and is idempotent.
    """
    with api_client() as client:
        asked = cancel_runs(client, child_run_ids(client, str(flow_run.id)), f"the multi-node launch {flow_run.name} ended {state.name}")
    if asked:
        try:
            get_run_logger().warning("Asked %d node run(s) to cancel: %s", len(asked), asked)
        except Exception:
            print(f"prefect-accelerate: asked node runs {asked} to cancel")


def _start_node(request: MultinodeRequest, rank: int, port: int, parent_key: str):
    from prefect.deployments import run_deployment

    node = request.node_request(rank, port)
    return run_deployment(
        request.node_deployment,
        parameters={"request": node.model_dump(mode="json")},
        flow_run_name=node_run_name(rank, request.num_machines),
        work_queue_name=request.queue(rank),
        job_variables=request.job_variables or None,
        tags=["prefect-accelerate", "multinode", f"rank-{rank}"],
        # a re-sent request (the API client retries) must not start a second run of the same node
        idempotency_key=f"{parent_key}-node-{rank}",
        timeout=0,
    )


def _summary_rows(result: MultinodeResult) -> list[dict[str, Any]]:
    return [
        {
            "rank": node.rank, "queue": node.work_queue, "flow run": node.flow_run_name, "state": node.state,
            "exit code": node.exit_code, "duration s": node.launch.duration_s if node.launch else None,
            "host": node.host, "message": node.message[:300],
        }
        for node in result.nodes
    ]


@flow(
    name="multinode-launch",
    flow_run_name=_multinode_flow_run_name,
    retries=0,
    persist_result=False,
    on_cancellation=[cancel_node_runs],
    on_crashed=[cancel_node_runs],
)
def multinode_launch(request: MultinodeRequest) -> MultinodeResult:
    """Launch on `num_machines` machines: one per-node deployment run each, on per-machine work queues.

    Starts the node runs (rank 0 first when the port is to be picked), waits for all of them, and if
    one fails, cancels the others. Cancelling this run cancels the node runs too.

    Returns:
        MultinodeResult with every node's final state and LaunchResult.

    Raises:
        LaunchError: a node failed, was cancelled, or never started (the message names it).

    Example:
        >>> multinode_launch(MultinodeRequest(script="train.py", num_machines=2, main_process_ip="10.0.0.5",
        ...                                   launch_flags={"multi_gpu": True, "num_processes": 16}))
    """
    from prefect.artifacts import create_table_artifact
    from prefect.runtime import flow_run

    logger = get_run_logger()
    parent_key = f"{flow_run.id}-{flow_run.run_count}"
    started: dict[int, str] = {}
    with api_client() as client:
        try:
            deployment = client.read_deployment_by_name(request.node_deployment)
        except Exception as error:
            raise LaunchError(
                f"The per-node deployment {request.node_deployment!r} was not found ({type(error).__name__}). Deploy it from "
                "the repository root: prefect --no-prompt deploy --all"
            ) from None
        pool = deployment.work_pool_name
        created = ensure_queues(client, request, pool)
        if created:
            logger.warning(
                "Created work queue(s) %s in pool %r. Each needs a worker on its machine: prefect worker start --pool %s "
                "--work-queue <queue>.", created, pool, pool,
            )
        try:
            port = request.main_process_port
            if port == 0:
                started[0] = str(_start_node(request, 0, 0, parent_key).id)
                logger.info("Started machine 0 on queue %r; waiting for the port it picks.", request.queue(0))
                port = wait_for_port(client, request, started[0], pool)
            for rank in range(request.num_machines):
                if rank not in started:
                    started[rank] = str(_start_node(request, rank, port, parent_key).id)
            logger.info(
                "Started %d node runs (rendezvous %s:%d) on queues %s.", request.num_machines, request.main_process_ip, port,
                [request.queue(r) for r in range(request.num_machines)],
            )
            runs, failed_rank, message = _watch(client, request, started, pool)
        except BaseException as error:
            # an error here, or this run being cancelled (Prefect raises in this thread): stop the nodes
            asked = cancel_runs(client, list(started.values()), f"the multi-node launch stopped: {type(error).__name__}")
            if asked:
                logger.warning("Asked %d node run(s) to cancel.", len(asked))
            raise
        settle_placeholders(client, runs)
        by_id = {run_id: rank for rank, run_id in started.items()}
        nodes = sorted((node_outcome(client, request, by_id[run_id], run) for run_id, run in runs.items()), key=lambda n: n.rank)
    ok = failed_rank is None and all(node.completed for node in nodes)
    result = MultinodeResult(
        ok=ok, main_process_ip=request.main_process_ip, main_process_port=port, nodes=nodes, failed_rank=failed_rank,
        message=message or ("" if ok else "Not every node completed."),
    )
    create_table_artifact(key=SUMMARY_KEY, table=_summary_rows(result), description=result.message or "All nodes completed.")
    if not ok:
        raise LaunchError(result.message + " " + "; ".join(f"machine {n.rank}: {n.state}" for n in nodes))
    return result


def _watch(client, request: MultinodeRequest, started: dict[int, str], pool: str | None) -> tuple[dict[str, Any], int | None, str]:
    """Poll the node runs until all are final; on the first failure cancel the others.

    Returns (runs by id, the first failed rank, a message).
    """
    logger = get_run_logger()
    rank_of = {run_id: rank for rank, run_id in started.items()}
    began = time.monotonic()
    cancel_deadline: float | None = None
    failed_rank: int | None = None
    message = ""
    while True:
        runs = read_runs(client, list(started.values()))
        if all(run.state is not None and run.state.is_final() for run in runs.values()) and len(runs) == len(started):
            return runs, failed_rank, message
        if cancel_deadline is None:
            for run_id, run in sorted(runs.items(), key=lambda item: rank_of[item[0]]):
                state = run.state
                rank = rank_of[run_id]
                if state is not None and (state.is_final() or state.is_cancelling()) and not state.is_completed():
                    failed_rank = rank
                    message = f"Machine {rank} ended {state.name}: {state.message or 'no message'}."
                    break
                if (state is None or state.is_scheduled() or state.is_pending()) and time.monotonic() - began > request.start_timeout:
                    failed_rank = rank
                    message = not_started_message(request, rank, pool)
                    break
            if failed_rank is not None:
                logger.error("%s Cancelling the other machines.", message)
                cancel_runs(client, list(started.values()), f"machine {failed_rank} of the multi-node launch failed")
                cancel_deadline = time.monotonic() + CANCEL_WAIT_SECONDS
        elif time.monotonic() > cancel_deadline:
            logger.warning("Some node runs did not finish cancelling within %.0f s.", CANCEL_WAIT_SECONDS)
            return runs, failed_rank, message
        time.sleep(request.poll_interval)


__all__ = [
    "NODE_DEPLOYMENT",
    "TOPOLOGY_FLAGS",
    "MultinodeRequest",
    "MultinodeResult",
    "NodeLaunchRequest",
    "NodeOutcome",
    "cancel_node_runs",
    "multinode_launch",
    "node_launch",
    "node_options",
    "node_queue_name",
]
