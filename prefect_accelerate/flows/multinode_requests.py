"""What a multi-node launch is asked to do, and what it reports: the deployments' parameter models.

`MultinodeRequest` is the parameter of the `multinode-launch` deployment, `NodeLaunchRequest` the one
of the per-node deployment (deployments/prefect.yaml); `MultinodeResult` and `NodeOutcome` are what
the parent returns. Plain pydantic, no Prefect: they validate (and name a wrong field) before any run
starts. flows/multinode.py, the deployments' entrypoint, re-exports them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from prefect_accelerate.launchers.result import LaunchResult

#: the deployment `multinode_launch` starts per machine (deployments/prefect.yaml)
NODE_DEPLOYMENT = "node-launch/per-node"
#: flags that are fields of the requests here, because each node gets its own value
TOPOLOGY_FLAGS = ("num_machines", "machine_rank", "main_process_ip", "main_process_port")


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
