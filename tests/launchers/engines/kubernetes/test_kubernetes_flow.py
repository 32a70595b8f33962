"""A Kubernetes launch inside a real Prefect flow run (the session's Prefect server), against the loopback API:
the launch task follows the job with every pod's lines in the run's log, and the flow's cancellation hook deletes it."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from prefect_accelerate.cli.main import build_parser
from prefect_accelerate.launchers.engines.kubernetes import job as kjob
from prefect_accelerate.launchers.engines.kubernetes.plan import plan as kubernetes_plan
from prefect_accelerate.launchers.host import StaticHost
from prefect_accelerate.launchers.options import options_from_namespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fakes"))
from kube_api import FakeKubernetes  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    with FakeKubernetes() as fake:
        monkeypatch.setenv("KUBECONFIG", str(fake.kubeconfig(tmp_path)))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        monkeypatch.setattr(kjob, "POLL_SECONDS", 0.1)
        yield fake


def _plan(tmp_path):
    args = build_parser().parse_args(["launch", "--kubernetes", "--kubernetes_image", "ghcr.io/acme/train:1", "--cpu",
                                      "--num_machines", "2", "--num_processes", "2", "train.py"])
    return kubernetes_plan(options_from_namespace(args), StaticHost(), cwd="/project", run_dir=str(tmp_path / "run"))


def _recorded(timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = [r for r in kjob.read_records(kjob.KUBERNETES_JOBS, this_host=False) if r.get("flow_run_id")]
        if records:
            return records[0]
        time.sleep(0.05)
    return {}


def test_the_launch_task_follows_the_job_and_the_flows_cancel_hook_deletes_it(cluster, prefect_harness, tmp_path):
    from prefect import flow

    from prefect_accelerate.errors import LaunchError
    from prefect_accelerate.flows.launch import end_launch_processes
    from prefect_accelerate.tasks.launch import launch

    plan = _plan(tmp_path)
    name = plan.request["job_name"]
    seen: dict = {}

    def cancel_like_prefect_would() -> None:
        seen["record"] = _recorded()
        while not cluster.pod_names(name):
            time.sleep(0.05)
        for index in (0, 1):
            cluster.run_pod(name, index)
            cluster.log(name, index, f"[default0]:training on node {index}")
        log = Path(plan.run_dir, "launch.log")
        deadline = time.monotonic() + 120
        # the task has followed both pods into their training before the cancellation comes (one poll may read pod 0
        # before its line and pod 1 after its own; a deleted job's logs are gone, so waiting on one line is not enough)
        while time.monotonic() < deadline and not (log.exists() and all(f"training on node {i}" in log.read_text() for i in (0, 1))):
            time.sleep(0.05)
        run = type("FlowRun", (), {"id": seen["record"].get("flow_run_id")})()
        end_launch_processes(None, run, None)  # what on_cancellation runs
        seen["pods_left"] = cluster.pod_names(name)

    @flow
    def train():
        return launch(plan=plan)

    canceller = threading.Thread(target=cancel_like_prefect_would, daemon=True)
    canceller.start()
    with pytest.raises(LaunchError, match="was deleted while it ran"):
        train()
    canceller.join(timeout=60)
    assert seen["record"].get("flow_run_id"), "the job was not recorded with its flow run"
    assert seen["pods_left"] == [] and ("default", name) not in cluster.jobs
    log = Path(plan.run_dir, "launch.log").read_text()
    assert "[node 0 rank 0] training on node 0" in log and "[node 1 rank 1] training on node 1" in log


def test_a_tracked_launch_that_succeeds_returns_the_jobs_result(cluster, prefect_harness, tmp_path):
    from prefect_accelerate.flows.launch import launch_flow

    plan = _plan(tmp_path)
    name = plan.request["job_name"]

    def finish() -> None:
        while not cluster.pod_names(name):
            time.sleep(0.05)
        for index in (0, 1):
            cluster.run_pod(name, index)
            cluster.log(name, index, f"[default0]:done on node {index}")
        time.sleep(0.5)
        for index in (0, 1):
            cluster.finish_pod(name, index, 0)

    threading.Thread(target=finish, daemon=True).start()
    state = launch_flow(plan=plan, return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert result.exit_code == 0 and result.launcher == "kubernetes" and result.job.state == "Succeeded"


def test_a_saved_cluster_block_gives_its_defaults_and_flags_still_win(prefect_harness, tmp_path):
    import yaml

    from prefect_accelerate.errors import ConfigError
    from prefect_accelerate.launchers.engines.kubernetes.block import KubernetesClusterBlock, load_cluster_block

    KubernetesClusterBlock(image="ghcr.io/acme/base:2", namespace="ml", gpus_per_node=8, tolerations=["nvidia.com/gpu:NoSchedule"],
                           secret_env={"HF_TOKEN": "hf-token:token"}).save("test-gpu-cluster", overwrite=True)
    args = build_parser().parse_args(["launch", "--kubernetes", "--kubernetes_block", "test-gpu-cluster", "--kubernetes_namespace", "other",
                                      "--multi_gpu", "--num_machines", "2", "--num_processes", "16", "train.py"])
    host = StaticHost(kind="cuda", count=8)
    plan = kubernetes_plan(options_from_namespace(args, host=host, environ={}), host, cwd="/p", run_dir=str(tmp_path / "run"))
    job = list(yaml.safe_load_all(plan.describe()))[1]
    pod = job["spec"]["template"]["spec"]
    assert job["metadata"]["namespace"] == "other" and pod["containers"][0]["image"] == "ghcr.io/acme/base:2"
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    with pytest.raises(ConfigError, match="No KubernetesClusterBlock named 'no-such-cluster'"):
        load_cluster_block("no-such-cluster")
