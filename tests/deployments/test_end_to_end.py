"""deployments/prefect.yaml end to end on 127.0.0.1: a real `prefect server`, a process work pool,
`prefect deploy` from the repository root, and two process workers standing in for two machines
(machine 0 polls `default` and `accelerate-node-0`, machine 1 polls `accelerate-node-1`).

Every training process writes its pid to a file; after a failure or a cancel the tests poll until
each of them is gone. The module shares one server, one deploy and the two workers; a served flow
(serve_project/, `flow.serve()`) is cancelled on the same server.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.processes import assert_all_gone, wait_for_pids
from helpers.prefect_server import PrefectServer, free_port, running_server, wait_for_state

REPO = Path(__file__).resolve().parents[2]
POOL = "accelerate"
EXAMPLE = "examples/ddp_allreduce.py"
NODE_JOB = str(Path(__file__).resolve().parent / "scripts" / "node_job.py")
SLEEPER = str(Path(__file__).resolve().parents[1] / "launchers" / "scripts" / "worker.py")
QUIET = {"cpu": True, "num_processes": 4, "mixed_precision": "no", "dynamo_backend": "no", "rdzv_conf": "join_timeout=120"}
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}

pytestmark = pytest.mark.slow


@dataclass
class Cluster:
    server: PrefectServer
    logs: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("deployments")
    with running_server(root / "prefect-home") as server:
        server.cli("work-pool", "create", "--type", "process", POOL)
        # the command deployments/README.md gives: the root's prefect.yaml links to deployments/prefect.yaml
        server.cli("deploy", "--all", cwd=str(REPO), timeout=240)
        # a worker polling a queue that does not exist polls nothing at all, silently, so machine 0's
        # queue comes first (that worker also serves `default`); machine 1's is left to multinode_launch,
        # which creates missing node queues (the worker finds the runs on its next poll)
        with server.client() as client:
            client.create_work_queue("accelerate-node-0", work_pool_name=POOL)
        server.start_worker(POOL, root / "machine-0.log", name="machine-0", queues=["default", "accelerate-node-0"])
        server.start_worker(POOL, root / "machine-1.log", name="machine-1", queues=["accelerate-node-1"])
        yield Cluster(server, root)


def multinode_params(script: str, port: int, **extra) -> dict:
    request = {"script": script, "num_machines": 2, "main_process_ip": "127.0.0.1", "main_process_port": port,
               "launch_flags": QUIET, "poll_interval": 1, "start_timeout": 180, **extra}
    return {"request": request}


def nodes_of(server: PrefectServer, parent_id: str) -> dict[str, object]:
    return {run.name: run for run in server.subflow_runs(parent_id)}


def table(server: PrefectServer, flow_run_id: str, key: str) -> list[dict]:
    import json

    found = [a for a in server.artifacts(flow_run_id) if a.key == key]
    assert found, f"no {key!r} artifact on {flow_run_id}: {[a.key for a in server.artifacts(flow_run_id)]}"
    return json.loads(found[0].data)


def test_deploy_from_the_repository_root_stores_the_checkout_as_working_directory(cluster):
    with cluster.server.client() as client:
        node = client.read_deployment_by_name("node-launch/per-node")
        parent = client.read_deployment_by_name("multinode-launch/cluster")
    assert node.entrypoint == "prefect_accelerate/flows/multinode.py:node_launch"
    assert node.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
    assert node.work_pool_name == POOL and parent.work_pool_name == POOL
    # typed form in the UI: the parameter is the pydantic model, with its fields
    schema = node.parameter_openapi_schema
    assert schema["required"] == ["request"]
    assert "machine_rank" in schema["definitions"]["NodeLaunchRequest"]["properties"]


def test_the_nightly_validation_is_scheduled_one_run_at_a_time(cluster):
    from prefect_accelerate.flows import validate

    with cluster.server.client() as client:
        nightly = client.read_deployment_by_name(f"{validate.validate_configs.name}/nightly")
    assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in nightly.schedules] == [("0 2 * * *", "UTC", True)]
    assert nightly.global_concurrency_limit.limit == 1
    assert nightly.parameters["request"]["configs"] == ["deployments/configs"]


def test_two_machines_on_two_queues_run_one_world_of_four(cluster):
    server = cluster.server
    parent = server.run_deployment("multinode-launch/cluster", multinode_params(EXAMPLE, 0))
    assert wait_for_state(server, parent, FINAL, timeout=240) == "COMPLETED", (
        server.logs(parent)[-20:]
    )
    nodes = nodes_of(server, parent)
    assert sorted(nodes) == ["node-launch-rank0-of-2", "node-launch-rank1-of-2"]
    assert "Created work queue(s) ['accelerate-node-1']" in server.logs_with([parent], "Created work queue(s) ['accelerate-node-1']")
    assert {run.state_type.value for run in nodes.values()} == {"COMPLETED"}
    assert nodes["node-launch-rank1-of-2"].work_queue_name == "accelerate-node-1"
    # port 0: machine 0 picked one and machine 1 was started with it
    port = table(server, str(nodes["node-launch-rank0-of-2"].id), "node-rendezvous")[0]["main_process_port"]
    assert nodes["node-launch-rank1-of-2"].parameters["request"]["main_process_port"] == port > 0
    expected = [f"rank {rank}/4: all_reduce sum = 10.0" for rank in range(4)]
    lines = server.logs_with([str(run.id) for run in nodes.values()], *expected)
    for line in expected:
        assert line in lines
    summary = table(server, parent, "multinode-launch")
    assert [(row["rank"], row["state"], row["exit code"]) for row in summary] == [(0, "Completed", 0), (1, "Completed", 0)]
    # run_deployment's placeholder task per node in the parent's graph ends with its node, not Pending
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with server.client() as client:
        placeholders = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[parent])))
    assert [t.state_type.value for t in placeholders] == ["COMPLETED", "COMPLETED"]


@pytest.fixture(scope="module")
def stopping_launches(cluster, tmp_path_factory) -> dict[str, tuple[str, Path]]:
    """Two multi-node launches started together (their start-ups overlap): one whose machine 1 fails,
    one that sleeps until it is cancelled. Returns mode -> (parent run id, pid folder)."""
    runs = {}
    for mode in ("fail_node1", "sleep"):
        pids = tmp_path_factory.mktemp(mode)
        env = {"env": {"NODE_JOB_MODE": mode, "NODE_JOB_PID_DIR": str(pids)}}
        runs[mode] = (cluster.server.run_deployment("multinode-launch/cluster", multinode_params(NODE_JOB, free_port(), job_variables=env)), pids)
    return runs


def test_a_failing_machine_fails_the_launch_and_cancels_the_other(cluster, stopping_launches):
    server = cluster.server
    parent, pids = stopping_launches["fail_node1"]
    started = wait_for_pids(pids, 4)
    assert wait_for_state(server, parent, FINAL, timeout=240) == "FAILED"
    nodes = nodes_of(server, parent)
    assert nodes["node-launch-rank1-of-2"].state_type.value == "FAILED"
    assert nodes["node-launch-rank0-of-2"].state_type.value == "CANCELLED"
    assert_all_gone(started, timeout=30)
    assert "Machine 1 ended Failed" in server.flow_run(parent).state.message
    summary = {row["rank"]: row for row in table(server, parent, "multinode-launch")}
    assert summary[1]["exit code"] == 3 and summary[0]["state"] == "Cancelled"


def test_cancelling_the_launch_cancels_every_machine(cluster, stopping_launches):
    server = cluster.server
    parent, pids = stopping_launches["sleep"]
    started = wait_for_pids(pids, 4)
    server.cli("flow-run", "cancel", parent)
    # the nodes' workers stop their flow runs; the launch task's grace (20 s) is below Prefect's 30 s
    assert_all_gone(started, timeout=60)
    assert wait_for_state(server, parent, FINAL, timeout=120) == "CANCELLED"
    for run in nodes_of(server, parent).values():
        assert wait_for_state(server, str(run.id), FINAL, timeout=60) == "CANCELLED"
    assert "node run(s) to cancel" in server.logs_with([parent], "node run(s) to cancel"), server.logs(parent)[-10:]


def test_nightly_validation_and_pipeline_deployments_complete_with_their_artifacts(cluster):
    from prefect_accelerate.flows import pipeline, validate

    server = cluster.server
    # both with the parameters prefect.yaml gives: deployments/configs (2 CPU processes) and the tiny example;
    # started together so their process start-ups overlap
    nightly = server.run_deployment(f"{validate.validate_configs.name}/nightly")
    training = server.run_deployment(f"{pipeline.launch_training.name}/on-demand")
    for run in (nightly, training):
        assert wait_for_state(server, run, FINAL, timeout=300) == "COMPLETED", server.logs(run)[-20:]
    rows = table(server, nightly, validate.VALIDATION_ARTIFACT_KEY)
    assert [(row["config"], row["ok"]) for row in rows] == [("cpu-2proc.yaml", "yes")], rows
    keys = {a.key for a in server.artifacts(training)}
    assert any(key.startswith("launch-result-") for key in keys) and any(key.startswith(pipeline.PIPELINE_ARTIFACT + "-") for key in keys), keys
    assert "rank 1/2: all_reduce sum = 3.0" in server.logs_with([str(training)], "rank 1/2: all_reduce sum = 3.0")


def test_cancelling_an_on_demand_training_run_ends_its_processes(cluster, tmp_path):
    from prefect_accelerate.flows import pipeline

    server = cluster.server
    pids = tmp_path / "pids"
    pids.mkdir()
    request = {"script": NODE_JOB, "config_file": "deployments/configs/cpu-2proc.yaml", "run_install_test": False}
    run = server.run_deployment(f"{pipeline.launch_training.name}/on-demand", {"request": request},
                                job_variables={"env": {"NODE_JOB_MODE": "sleep", "NODE_JOB_PID_DIR": str(pids)}})
    started = wait_for_pids(pids, 2)
    server.cli("flow-run", "cancel", run)
    # the worker cancels the deployment's run; its cancellation hook and the launch task end both ranks
    assert_all_gone(started, timeout=60)
    assert wait_for_state(server, run, FINAL, timeout=120) == "CANCELLED", server.logs(run)[-20:]


def test_cancelling_a_served_launch_ends_its_processes(cluster, tmp_path):
    """The same promise under `flow.serve()` (no worker): the served process runs the flow and its hook."""
    import time

    server = cluster.server
    project = Path(__file__).resolve().parent / "serve_project"
    server.start([sys.executable, "flows.py"], tmp_path / "serve.log", cwd=str(project))
    deadline = time.monotonic() + 120
    while server.cli("deployment", "inspect", "sleepy-launch/served", check=False).returncode != 0:
        assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-2000:]
        time.sleep(1)
    pids = tmp_path / "pids"
    pids.mkdir()
    run = server.run_deployment("sleepy-launch/served", {"pid_dir": str(pids), "worker": SLEEPER})
    started = wait_for_pids(pids, 2)
    wait_for_state(server, run, {"RUNNING"})
    server.cli("flow-run", "cancel", run)
    # the task's own clean-up: SIGTERM to torchrun, 10 s of grace, then SIGKILL; well under Prefect's 30 s
    assert_all_gone(started, timeout=45)
    assert wait_for_state(server, run, FINAL, timeout=120) == "CANCELLED", server.logs(run)[-20:]
