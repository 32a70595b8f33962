"""The Kubernetes job handle through the official `kubernetes` client, against a loopback API server.

The server (tests/launchers/fakes/kube_api.py) answers the REST paths the client calls with objects shaped as the
API documents them; the client finds it through a kubeconfig file (KUBECONFIG), as it would find a cluster.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefect_accelerate.cli.main import build_parser
from prefect_accelerate.errors import LaunchError
from prefect_accelerate.launchers.engines.kubernetes import job as kjob
from prefect_accelerate.launchers.engines.kubernetes.plan import plan as kubernetes_plan
from prefect_accelerate.launchers.host import StaticHost
from prefect_accelerate.launchers.options import options_from_namespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fakes"))
from kube_api import FakeKubernetes  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    with FakeKubernetes() as fake:
        monkeypatch.setenv("KUBECONFIG", str(fake.kubeconfig(tmp_path)))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield fake


def _plan(tmp_path, *extra: str, nodes: int = 2, per_node: int = 2):
    args = build_parser().parse_args(["launch", "--kubernetes", "--kubernetes_image", "ghcr.io/acme/train:1", "--cpu",
                                      "--num_machines", str(nodes), "--num_processes", str(nodes * per_node), *extra, "train.py"])
    return kubernetes_plan(options_from_namespace(args), StaticHost(), cwd="/project", run_dir=str(tmp_path / "run"))


def test_submit_creates_the_job_then_its_service_owned_by_the_job(cluster, tmp_path):
    plan = _plan(tmp_path)
    run = kjob.KubernetesJobRun.submit(plan, output=lambda *a: None)
    posts = [(m, p) for m, p, _, _ in cluster.requests if m == "POST"]
    assert posts == [("POST", "/apis/batch/v1/namespaces/default/jobs"), ("POST", "/api/v1/namespaces/default/services")]
    job = cluster.jobs[("default", run.name)]
    service = cluster.services[("default", run.name)]
    assert service["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    assert service["spec"]["clusterIP"] == "None"
    assert len(cluster.pod_names(run.name)) == 2
    assert run.describe().state == "Pending"


def test_status_follows_the_pods_and_the_jobs_conditions(cluster, tmp_path):
    run = kjob.KubernetesJobRun.submit(_plan(tmp_path), output=lambda *a: None)
    cluster.run_pod(run.name, 0)
    assert run.describe().state == "Running"
    cluster.run_pod(run.name, 1)
    cluster.finish_pod(run.name, 0, 0)
    assert run.describe().state == "Running"
    cluster.finish_pod(run.name, 1, 0)
    job = run.describe()
    assert job.state == "Succeeded" and job.finished and [p.exit_code for p in job.pods] == [0, 0]
    assert run.result().failed_node is None


def test_logs_come_from_every_pod_labelled_by_node_and_rank(cluster, tmp_path):
    run = kjob.KubernetesJobRun.submit(_plan(tmp_path), output=lambda *a: None)
    for index in (0, 1):
        cluster.run_pod(run.name, index)
    cluster.log(run.name, 0, "[prefect-accelerate] node 0 of 2: resolved", "[default0]:loss 1.0", "[default1]:loss 1.1")
    cluster.log(run.name, 1, "[default0]:loss 2.0", "[default1]:loss 2.1")
    run.describe()
    first = run.new_log_lines()
    assert ("node 0", "[prefect-accelerate] node 0 of 2: resolved") in first
    assert {("node 0 rank 0", "loss 1.0"), ("node 0 rank 1", "loss 1.1"), ("node 1 rank 2", "loss 2.0"), ("node 1 rank 3", "loss 2.1")} <= set(first)
    cluster.log(run.name, 1, "[default1]:loss 0.5")
    assert run.new_log_lines() == [("node 1 rank 3", "loss 0.5")]  # nothing read twice
    assert run.new_log_lines() == []


def test_lines_written_in_the_same_instant_are_each_taken_once():
    stamps = ["2026-12-06T02:40:00.1234Z", "2026-12-06T02:40:00.12345Z", "2026-12-06T02:40:01Z"]
    assert sorted(stamps, key=kjob.stamp_key) == stamps  # trailing zeros dropped: no string order

    class Core:
        text = ""

        def read_namespaced_pod_log(self, *args, **kwargs):
            return self.text

    core = Core()

    class Run(kjob.KubernetesJobRun):
        @property
        def core(self):
            return core

    run = Run("pa-x-000000", "default", client=object())
    pod = kjob.KubernetesPod(name="pa-x-000000-0-abcde", node=0)
    core.text = "2026-12-06T02:40:00Z a\n2026-12-06T02:40:00Z a\n"
    assert run._pod_lines(pod) == ["a", "a"]
    core.text = "2026-12-06T02:40:00Z a\n2026-12-06T02:40:00Z a\n2026-12-06T02:40:00Z b\n2026-12-06T02:40:01.5Z c\n"
    assert run._pod_lines(pod) == ["b", "c"]


def test_a_failing_pod_fails_the_job_and_the_result_names_its_node_rank_code_and_last_lines(cluster, tmp_path):
    run = kjob.KubernetesJobRun.submit(_plan(tmp_path), output=lambda *a: None)
    for index in (0, 1):
        cluster.run_pod(run.name, index)
    cluster.log(run.name, 1, "[default1]:Traceback (most recent call last):", "[default1]:ValueError: bad batch on rank 3",
                "torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: 7) local_rank: 1",
                "Root Cause (first observed failure):", "[0]:", "  time      : 2026-12-06_02:40:00", "  host      : pa-train-1",
                "  rank      : 3 (local_rank: 1)", "  exitcode  : 7 (pid: 42)")
    run.new_log_lines()
    cluster.finish_pod(run.name, 1, 1)  # torchrun exits 1 when a worker fails
    job = run.describe()
    assert job.state == "Failed" and job.reason == "PodFailurePolicy"
    assert [p.exit_code for p in job.pods] == [143, 1]  # the controller ended pod 0
    result = run.result()
    assert (result.failed_node, result.failed_rank, result.exit_code) == (1, 3, 7)
    assert result.failed_pod == cluster.pod_names(run.name)[1]
    assert result.error == "ValueError: bad batch on rank 3"
    assert "  rank      : 3 (local_rank: 1)" in result.failed_tail
    text = kjob.failure_text(result)
    assert "node 1" in text and "rank 3" in text and "exit code 7" in text


def test_stop_deletes_in_the_foreground_and_no_pod_survives(cluster, tmp_path):
    run = kjob.KubernetesJobRun.submit(_plan(tmp_path), output=lambda *a: None, poll_seconds=0.05)
    cluster.run_pod(run.name, 0)
    run.describe()
    job = run.stop(wait_seconds=10)
    deletes = [(p, q, b) for m, p, q, b in cluster.requests if m == "DELETE"]
    assert deletes[0][0] == f"/apis/batch/v1/namespaces/default/jobs/{run.name}"
    assert (deletes[0][2] or {}).get("propagationPolicy") == "Foreground" or deletes[0][1].get("propagationPolicy") == ["Foreground"]
    assert job.state == "Stopped" and run.finished
    assert cluster.pod_names(run.name) == [] and ("default", run.name) not in cluster.jobs
    assert ("default", run.name) not in cluster.services


def _background(cluster, name, steps):
    def act():
        for delay, action in steps:
            time.sleep(delay)
            while not cluster.pod_names(name):
                time.sleep(0.02)
            action()
    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    return thread


def test_run_job_follows_a_failing_launch_to_its_result_with_every_pods_lines(cluster, tmp_path):
    plan = _plan(tmp_path)
    name = plan.request["job_name"]
    lines: list[tuple[str, str]] = []
    _background(cluster, name, [
        (0.1, lambda: (cluster.run_pod(name, 0), cluster.run_pod(name, 1))),
        (0.2, lambda: (cluster.log(name, 0, "[default0]:step 1"), cluster.log(name, 1, "[default0]:step 1"))),
        (0.3, lambda: cluster.log(name, 0, "[default1]:RuntimeError: out of patience", "  rank      : 1 (local_rank: 1)", "  exitcode  : 3 (pid: 9)")),
        (0.3, lambda: cluster.finish_pod(name, 0, 1)),
    ])
    result = kjob.run_job(plan, on_line=lambda label, line: lines.append((label, line)), poll_seconds=0.05, timeout=60)
    assert result.exit_code == 3 and not result.succeeded
    assert result.job.failed_node == 0 and result.root_cause_rank == 1
    assert ("node 0 rank 0", "step 1") in lines and ("node 1 rank 2", "step 1") in lines
    assert "RuntimeError: out of patience" in result.error
    assert Path(result.log_path).read_text().count("step 1") == 2
    assert kjob.read_records(kjob.KUBERNETES_JOBS) == []  # the record is gone once the job ended


def test_run_job_deletes_the_job_at_the_deadline(cluster, tmp_path):
    plan = _plan(tmp_path)
    name = plan.request["job_name"]
    _background(cluster, name, [(0.05, lambda: cluster.run_pod(name, 0))])
    result = kjob.run_job(plan, on_line=lambda *a: None, poll_seconds=0.05, timeout=1.0)
    assert result.timed_out and result.exit_code == 124
    assert cluster.pod_names(name) == [] and ("default", name) not in cluster.jobs


def test_a_pod_that_can_never_start_fails_the_launch_at_once_and_deletes_the_job(cluster, tmp_path):
    plan = _plan(tmp_path)
    name = plan.request["job_name"]
    _background(cluster, name, [(0.05, lambda: cluster.wait_pod(name, 1, "ImagePullBackOff", 'Back-off pulling image "ghcr.io/acme/train:1"'))])
    with pytest.raises(LaunchError, match="can never start: ImagePullBackOff") as caught:
        kjob.run_job(plan, on_line=lambda *a: None, poll_seconds=0.05, timeout=60)
    assert caught.value.exit_code == 2
    assert cluster.pod_names(name) == [] and ("default", name) not in cluster.jobs


def test_an_interrupt_while_following_deletes_the_job(cluster, tmp_path):
    plan = _plan(tmp_path)
    name = plan.request["job_name"]
    calls = {"n": 0}

    def on_line(label, line):
        calls["n"] += 1
        if "Running" in line:
            raise KeyboardInterrupt

    _background(cluster, name, [(0.05, lambda: cluster.run_pod(name, 0))])
    with pytest.raises(KeyboardInterrupt):
        kjob.run_job(plan, on_line=on_line, poll_seconds=0.05, timeout=60)
    assert cluster.pod_names(name) == [] and ("default", name) not in cluster.jobs


def test_the_flows_cancellation_hook_deletes_the_recorded_job(cluster, tmp_path):
    plan = _plan(tmp_path)
    run = kjob.KubernetesJobRun.submit(plan, output=lambda *a: None)
    cluster.run_pod(run.name, 0)
    kjob.write_record(kjob.KUBERNETES_JOBS, "r-" + run.name, {"job_name": run.name, "namespace": "default", "flow_run_id": "flow-1"})
    assert kjob.delete_recorded_jobs("other-flow") == []
    assert kjob.delete_recorded_jobs("flow-1") == [f"default/{run.name}"]
    deletes = [(p, b) for m, p, _, b in cluster.requests if m == "DELETE" and "/jobs/" in p]
    assert deletes and deletes[0][1]["propagationPolicy"] == "Foreground"
    assert cluster.pod_names(run.name) == []
    assert kjob.delete_recorded_jobs("flow-1") == []  # idempotent: the record is gone


def test_a_job_the_hook_could_not_delete_keeps_its_record_for_the_next_try(cluster, tmp_path, monkeypatch, capsys):
    kjob.write_record(kjob.KUBERNETES_JOBS, "r-kept", {"job_name": "pa-kept-000000", "namespace": "default", "flow_run_id": "flow-2"})
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))  # the cluster cannot be reached now
    assert kjob.delete_recorded_jobs("flow-2") == []
    assert "kubectl delete job pa-kept-000000 -n default --cascade=foreground" in capsys.readouterr().out
    assert [r["job_name"] for r in kjob.read_records(kjob.KUBERNETES_JOBS, "flow-2", this_host=False)] == ["pa-kept-000000"]
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path)))
    assert kjob.delete_recorded_jobs("flow-2") == ["default/pa-kept-000000"]  # 404: already gone counts as deleted
    assert kjob.read_records(kjob.KUBERNETES_JOBS, "flow-2", this_host=False) == []


def test_the_engine_hook_of_launch_flows_reaches_kubernetes_jobs():
    from prefect_accelerate.launchers.engines import ENGINES

    assert ENGINES["kubernetes"].stopper() is kjob.delete_recorded_jobs


def test_a_name_that_exists_already_is_a_refusal_with_nothing_left_behind(cluster, tmp_path):
    plan = _plan(tmp_path)
    kjob.KubernetesJobRun.submit(plan, output=lambda *a: None)
    with pytest.raises(LaunchError, match="HTTP 409") as caught:
        kjob.KubernetesJobRun.submit(plan, output=lambda *a: None)
    assert caught.value.exit_code == 2


def test_no_kubeconfig_is_one_paragraph_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(LaunchError, match="No Kubernetes cluster to submit to") as caught:
        kjob.api_client()
    assert caught.value.exit_code == 2


@pytest.mark.parametrize(("pod_codes", "exit_code"), [((0, 0), 0), ((0, 5), 5)])
def test_launch_kubernetes_from_the_command_line_exits_with_the_trainings_code(cluster, tmp_path, monkeypatch, capsys, pod_codes, exit_code):
    from prefect_accelerate.cli.main import main

    monkeypatch.setattr(kjob, "POLL_SECONDS", 0.05)
    argv = ["launch", "--no-track", "--kubernetes", "--kubernetes_image", "ghcr.io/acme/train:1", "--cpu", "--num_machines", "2",
            "--num_processes", "2", "--run_dir", str(tmp_path / "run"), "train.py", "--epochs", "1"]
    name = _plan(tmp_path).request["job_name"]  # derived from the script, the run folder and the node count

    def finish():
        for index in (0, 1):
            cluster.run_pod(name, index)
            cluster.log(name, index, f"[default0]:node {index} says hello")
        time.sleep(0.2)
        for index, code in enumerate(pod_codes):
            cluster.finish_pod(name, index, code)

    _background(cluster, name, [(0.05, finish)])
    assert main(argv) == exit_code
    out = capsys.readouterr()
    assert "[node 1 rank 1] node 1 says hello" in out.out
    if exit_code:
        assert f"exit code {exit_code}" in out.err and "node 1" in out.err


def test_the_launch_flows_cancellation_hook_deletes_a_running_kubernetes_job(cluster, tmp_path):
    from types import SimpleNamespace

    from prefect_accelerate.flows.launch import end_launch_processes

    run = kjob.KubernetesJobRun.submit(_plan(tmp_path), output=lambda *a: None)
    cluster.run_pod(run.name, 0)
    cluster.run_pod(run.name, 1)
    kjob.write_record(kjob.KUBERNETES_JOBS, "r-hook", {"job_name": run.name, "namespace": "default", "flow_run_id": "0f1e-cancelled"})
    end_launch_processes(None, SimpleNamespace(id="0f1e-cancelled"), None)  # what Prefect calls on Cancelling/Crashed
    assert cluster.pod_names(run.name) == []
    assert run.describe().state == "Deleted"  # gone from the API, deleted by someone else than this handle
    assert ("default", run.name) not in cluster.jobs and ("default", run.name) not in cluster.services


def test_a_brief_api_outage_is_waited_out_and_a_refusal_is_one_paragraph(cluster, tmp_path):
    run = kjob.KubernetesJobRun.submit(_plan(tmp_path), output=lambda *a: None, poll_seconds=0.01)
    answers = iter([503, 503])
    original = cluster.handle

    def flaky(method, path, query, body):
        code = next(answers, None) if method == "GET" and "/jobs/" in path else None
        if code:
            return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": "etcd is busy", "code": code}, "json"
        return original(method, path, query, body)

    cluster.handle = flaky
    for index in (0, 1):
        cluster.run_pod(run.name, index)
        cluster.finish_pod(run.name, index, 0)
    assert run.wait(timeout=30).state == "Succeeded"

    def forbidden(method, path, query, body):
        if method == "GET" and "/jobs/" in path:
            return 403, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": "jobs.batch is forbidden", "code": 403}, "json"
        return original(method, path, query, body)

    cluster.handle = forbidden
    with pytest.raises(LaunchError, match="HTTP 403.*rbac.yaml"):
        run.wait(timeout=30)


def test_a_job_deleted_from_outside_ends_the_launch_as_deleted_not_as_a_deadline(cluster, tmp_path):
    plan = _plan(tmp_path)
    name = plan.request["job_name"]

    def delete_it():
        cluster.handle("DELETE", f"/apis/batch/v1/namespaces/default/jobs/{name}", {}, {"propagationPolicy": "Foreground"})

    _background(cluster, name, [(0.0, delete_it)])  # possibly before the handle ever read the Job
    result = kjob.run_job(plan, on_line=lambda *a: None, poll_seconds=0.05)
    assert result.job.state == "Deleted" and not result.timed_out and result.exit_code == 1
    assert "was deleted while it ran" in result.error


def test_pods_still_unscheduled_after_the_pending_timeout_delete_the_job_and_exit_2(cluster, tmp_path):
    # 5 s: room for the thread that places pod 0 on a loaded machine
    plan = _plan(tmp_path, "--kubernetes_pending_timeout", "5")
    name = plan.request["job_name"]
    cluster.schedule_on_create = False  # unplaced until the scheduler acts: no poll can see pod 1 placed first
    _background(cluster, name, [(0.0, lambda: (cluster.run_pod(name, 0), cluster.unschedule_pod(
        name, 1, "0/12 nodes are available: 12 Insufficient nvidia.com/gpu.")))])
    started = time.monotonic()
    with pytest.raises(LaunchError, match=r"1 of the 2 pods .* still not scheduled after 5 s \(node 1: Unschedulable: 0/12 nodes") as caught:
        kjob.run_job(plan, on_line=lambda *a: None, poll_seconds=0.05, timeout=60)
    assert caught.value.exit_code == 2 and time.monotonic() - started < 30
    assert cluster.pod_names(name) == [] and ("default", name) not in cluster.jobs  # pod 0 holds nothing now


def test_a_pending_timeout_does_not_touch_a_job_whose_pods_were_all_placed(cluster, tmp_path):
    plan = _plan(tmp_path, "--kubernetes_pending_timeout", "0.5")
    name = plan.request["job_name"]
    _background(cluster, name, [(0.0, lambda: (cluster.run_pod(name, 0), cluster.run_pod(name, 1))),
                                (1.0, lambda: (cluster.finish_pod(name, 0, 0), cluster.finish_pod(name, 1, 0)))])
    result = kjob.run_job(plan, on_line=lambda *a: None, poll_seconds=0.05, timeout=60)
    assert result.exit_code == 0 and result.job.state == "Succeeded"


_ACTIONS = st.lists(st.tuples(st.sampled_from(["run", "log", "finish0", "fail", "poll"]), st.integers(min_value=0, max_value=3)), max_size=8)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(nodes=st.integers(min_value=1, max_value=4), actions=_ACTIONS)
def test_whatever_the_pods_did_stop_leaves_no_pod_no_job_and_no_service(nodes, actions, cluster, tmp_path_factory):
    run = kjob.KubernetesJobRun.submit(_plan(tmp_path_factory.mktemp("stop"), nodes=nodes, per_node=1), output=lambda *a: None, poll_seconds=0.01)
    for action, index in actions:
        index %= nodes
        pod = cluster.pod(run.name, index)
        if action == "run" and pod["status"]["phase"] == "Pending":
            cluster.run_pod(run.name, index)
        elif action == "log" and pod["status"]["phase"] == "Running":
            cluster.log(run.name, index, "[default0]:step")
        elif action in ("finish0", "fail") and pod["status"]["phase"] == "Running":
            cluster.finish_pod(run.name, index, 0 if action == "finish0" else 1)
        elif action == "poll":
            run.poll()
    run.stop(wait_seconds=30)
    assert cluster.pod_names(run.name) == []
    assert ("default", run.name) not in cluster.jobs and ("default", run.name) not in cluster.services
    assert run.status == "Stopped"
