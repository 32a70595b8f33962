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
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from pydantic import BaseModel, ConfigDict, Field, model_validator

from prefect_accelerate.errors import LaunchError
from prefect_accelerate.flows.launch import end_launch_processes
from prefect_accelerate.launchers.result import LaunchResult

#: the deployment `multinode_launch` starts per machine (deployments/prefect.yaml)
NODE_DEPLOYMENT = "node-launch/per-node"
#: artifact keys: rank 0's address and port, and each node's result
RENDEZVOUS_KEY = "node-rendezvous"
NODE_RESULT_KEY = "node-launch-result"
SUMMARY_KEY = "multinode-launch"
#: after asking the other nodes to cancel: their worker's 30 s kill grace plus our launch grace, and margin
CANCEL_WAIT_SECONDS = 90.0
#: flags that are fields of the requests here, because each node gets its own value
TOPOLOGY_FLAGS = ("num_machines", "machine_rank", "main_process_ip", "main_process_port")
_TAIL_IN_ARTIFACT = 10


def _check_launch_flags(flags: dict[str, Any]) -> None:
    """ValueError (pydantic reports it as a field error) for a topology flag or an unknown flag."""
    from prefect_accelerate.errors import did_you_mean
    from prefect_accelerate.launchers.options import OPTION_FIELDS

    for name in flags:
        if name in TOPOLOGY_FLAGS:
            raise ValueError(
                f"launch_flags sets {name!r}, which the multi-node launch sets for each machine. Remove it from "
                "launch_flags and use the request's own num_machines / main_process_ip / main_process_port fields."
            )
        if name not in OPTION_FIELDS:
            raise ValueError(
                f"Unknown launch flag {name!r} in launch_flags.{did_you_mean(name, OPTION_FIELDS)} Launch flags are the "
                "`accelerate launch` flag names without dashes, e.g. num_processes."
            )


class _LaunchWhat(BaseModel):
    """What every node runs: the same script, config and flags."""

    model_config = ConfigDict(extra="forbid")

    script: str = Field(description="The training script, as a path on each machine (relative paths: relative to cwd).")
    script_args: list[str] = Field(default_factory=list)
    config_file: str | None = Field(None, description="Accelerate config file on each machine; the default config when empty.")
    launch_flags: dict[str, Any] = Field(
        default_factory=dict,
        description="`accelerate launch` flags by destination name (num_processes = all machines' processes, cpu, "
        "mixed_precision, rdzv_backend, ...). The topology flags are fields of their own.",
    )
    timeout: float | None = Field(None, gt=0, description="Deadline for each node's launch, in seconds.")
    cwd: str | None = Field(None, description="Working directory of the launch on each machine (default: the flow run's).")

    @model_validator(mode="after")
    def _flags_are_launch_flags(self):
        _check_launch_flags(self.launch_flags)
        return self


class NodeLaunchRequest(_LaunchWhat):
    """One machine's part of a multi-node launch (the per-node deployment's parameter)."""

    num_machines: int = Field(ge=1, description="How many machines take part.")
    machine_rank: int = Field(ge=0, description="This machine's rank; 0 is the main machine.")
    main_process_ip: str = Field(description="Address of the machine of rank 0, reachable from every machine.")
    main_process_port: int = Field(
        0, ge=0, le=65535, description="Port on the main machine; 0 (rank 0 only): pick a free one and publish it."
    )

    @model_validator(mode="after")
    def _rank_fits(self):
        if self.machine_rank >= self.num_machines:
            raise ValueError(f"machine_rank {self.machine_rank} is not below num_machines {self.num_machines}.")
        if self.main_process_port == 0 and self.machine_rank != 0:
            raise ValueError(
                f"machine_rank {self.machine_rank} needs the main machine's port: main_process_port 0 (pick a free one) "
                "only works on rank 0, which publishes the port it picked. Start nodes through multinode_launch, or pass the port."
            )
        return self


class MultinodeRequest(_LaunchWhat):
    """A launch over several machines, one per-node flow run each (the multi-node deployment's parameter)."""

    num_machines: int = Field(2, ge=1, description="How many machines take part (one work queue each).")
    main_process_ip: str = Field(description="Address of the machine of rank 0, reachable from every machine.")
    main_process_port: int = Field(
        0, ge=0, le=65535, description="Port on the main machine; 0: the rank-0 node picks a free one before the others start."
    )
    node_deployment: str = Field(NODE_DEPLOYMENT, description="The per-node deployment, as flow-name/deployment-name.")
    work_queues: list[str] = Field(
        default_factory=list, description="One work queue per machine, in rank order; empty: <work_queue_prefix>-node-<rank>."
    )
    work_queue_prefix: str = Field("accelerate", description="Prefix of the default per-node queue names.")
    job_variables: dict[str, Any] = Field(
        default_factory=dict, description='Infrastructure overrides for every node run, e.g. {"env": {"NCCL_DEBUG": "INFO"}}.'
    )
    start_timeout: float = Field(
        600.0, gt=0, description="Seconds a node may wait for its worker before the launch is given up (and the others cancelled)."
    )
    poll_interval: float = Field(2.0, gt=0, description="Seconds between state checks.")

    @model_validator(mode="after")
    def _one_queue_per_machine(self):
        if self.work_queues and len(self.work_queues) != self.num_machines:
            raise ValueError(
                f"work_queues names {len(self.work_queues)} queue(s) for {self.num_machines} machines; give one per machine "
                "in rank order, or leave it empty for <work_queue_prefix>-node-<rank>."
            )
        return self

    def queue(self, rank: int) -> str:
        return self.work_queues[rank] if self.work_queues else node_queue_name(rank, self.work_queue_prefix)

    def node_request(self, rank: int, port: int) -> NodeLaunchRequest:
        what = self.model_dump(include=set(_LaunchWhat.model_fields))
        return NodeLaunchRequest(
            **what, num_machines=self.num_machines, machine_rank=rank, main_process_ip=self.main_process_ip, main_process_port=port
        )


class NodeOutcome(BaseModel):
    """How one machine's launch ended."""

    rank: int
    work_queue: str
    flow_run_id: str
    flow_run_name: str
    #: the node run's final state name: Completed, Failed, Cancelled, Crashed (or where it stopped)
    state: str
    message: str = ""
    exit_code: int | None = None
    host: str | None = None
    launch: LaunchResult | None = None

    @property
    def completed(self) -> bool:
        return self.state == "Completed"


class MultinodeResult(BaseModel):
    """Every node's outcome; `ok` when all of them completed."""

    ok: bool
    main_process_ip: str
    main_process_port: int
    nodes: list[NodeOutcome] = Field(default_factory=list)
    #: the first node that failed on its own (the others were then cancelled)
    failed_rank: int | None = None
    message: str = ""


def node_queue_name(rank: int, prefix: str = "accelerate") -> str:
    """The default work queue of machine `rank`: `<prefix>-node-<rank>`."""
    return f"{prefix}-node-{rank}"


def node_run_name(rank: int, machines: int) -> str:
    return f"node-launch-rank{rank}-of-{machines}"


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
    """A TCP port free on every interface of this machine (torchrun's store listens on all of them)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def node_options(request: NodeLaunchRequest, port: int):
    """LaunchOptions for one machine: the shared flags plus this machine's rank and the rendezvous address."""
    from prefect_accelerate.launchers.options import build_launch_options

    flags = dict(request.launch_flags)
    flags.update(
        num_machines=request.num_machines, machine_rank=request.machine_rank, main_process_ip=request.main_process_ip,
        main_process_port=port,
    )
    if request.timeout is not None:
        flags["timeout"] = request.timeout
    return build_launch_options(request.script, request.script_args, config_file=request.config_file, **flags)


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


def _client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def _read_runs(client, ids: list[str]) -> dict[str, Any]:
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
    for run_id, run in _read_runs(client, ids).items():
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


def _child_run_ids(client, parent_id: str) -> list[str]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])))
    return [str(run.id) for run in runs]


def cancel_node_runs(flow, flow_run, state) -> None:  # noqa: ARG001 - Prefect's hook signature
    """Hook (parent cancelled or crashed): cancel the node runs it started.

    `run_deployment` records each node run as a subflow of the parent, so the hook finds them through
    the API; it may run in the parent's process or in its worker, and is idempotent.
    """
    with _client() as client:
        asked = cancel_runs(client, _child_run_ids(client, str(flow_run.id)), f"the multi-node launch {flow_run.name} ended {state.name}")
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


def _not_started_message(request: MultinodeRequest, rank: int, pool: str | None) -> str:
    queue = request.queue(rank)
    return (
        f"Machine {rank}'s node run did not start within {request.start_timeout:.0f} s: no worker took it from work queue "
        f"{queue!r}. Start one on that machine: prefect worker start --pool {pool or '<pool>'} --work-queue {queue}"
    )


def _wait_for_port(client, request: MultinodeRequest, run_id: str, pool: str | None) -> int:
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
            raise LaunchError(_not_started_message(request, 0, pool))
        time.sleep(min(request.poll_interval, 1.0))


def _outcome(client, request: MultinodeRequest, rank: int, run) -> NodeOutcome:
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


def _settle_placeholders(client, runs: dict[str, Any]) -> None:
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
    with _client() as client:
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
                port = _wait_for_port(client, request, started[0], pool)
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
        _settle_placeholders(client, runs)
        by_id = {run_id: rank for rank, run_id in started.items()}
        nodes = sorted((_outcome(client, request, by_id[run_id], run) for run_id, run in runs.items()), key=lambda n: n.rank)
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
        runs = _read_runs(client, list(started.values()))
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
                    message = _not_started_message(request, rank, pool)
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
