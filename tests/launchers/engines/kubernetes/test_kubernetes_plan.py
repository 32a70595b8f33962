"""The Kubernetes plan (pure): golden manifests for 2 and 64 nodes, strict schema validation against a current
Kubernetes release, valid names for any script and node count, no secret value in any manifest."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from prefect_accelerate.cli.main import build_parser
from prefect_accelerate.errors import UsageError
from prefect_accelerate.launchers.engines.kubernetes import plan as kplan
from prefect_accelerate.launchers.host import StaticHost
from prefect_accelerate.launchers.options import options_from_namespace

REPO = Path(__file__).resolve().parents[4]
GOLDEN = REPO / "tests" / "golden" / "kubernetes"
#: the newest Kubernetes schema kubernetes-validate ships (1.37 with kubernetes-validate 1.37.0)
K8S_VERSION = kubernetes_validate.latest_version()
CASES = {
    "two-nodes-cpu": ["--cpu", "--num_machines", "2", "--num_processes", "4", "--mixed_precision", "no", "--dynamo_backend", "no",
                      "--kubernetes_cpu_per_node", "4", "--kubernetes_memory_per_node", "8Gi"],
    "sixty-four-nodes-gpus": [
        "--multi_gpu", "--mixed_precision", "bf16", "--dynamo_backend", "no", "--num_machines", "64", "--num_processes", "512",
        "--kubernetes_namespace", "ml-training", "--kubernetes_gpus_per_node", "8", "--kubernetes_cpu_per_node", "96",
        "--kubernetes_memory_per_node", "1800Gi", "--kubernetes_service_account", "trainer",
        "--kubernetes_image_pull_secret", "registry-credentials",
        "--kubernetes_node_selector", "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3",
        "--kubernetes-toleration", "nvidia.com/gpu:NoSchedule", "--kubernetes_toleration", "dedicated=training:NoExecute",
        "--kubernetes_secret_env", "HF_TOKEN=hf-token:token", "--kubernetes-secret-env", "WANDB_API_KEY=wandb:api-key",
        "--kubernetes_working_dir", "/workspace", "--main_process_port", "29400"],
}
GPU8 = StaticHost(kind="cuda", count=8, cores=2, python_path="/opt/venv/bin/python")


def _options(extra: list[str], script: str = "train.py", args: tuple[str, ...] = ("--lr", "3e-4")):
    parsed = build_parser().parse_args(["launch", "--kubernetes", "--kubernetes_image", "ghcr.io/acme/train:2026-12", *extra, script, *args])
    return options_from_namespace(parsed, host=GPU8, environ={})


def _plan(extra: list[str], **kwargs):
    return kplan.plan(_options(extra, **kwargs), GPU8, cwd="/project", run_dir="/runs/r1")


def _documents(plan) -> list[dict]:
    return list(yaml.safe_load_all(plan.describe()))


@pytest.mark.parametrize("name", sorted(CASES))
def test_dry_run_matches_golden_file(name, monkeypatch):
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    for variable in (kplan.NAMESPACE_ENV, kplan.OWNER_POD_ENV, kplan.OWNER_UID_ENV):
        monkeypatch.delenv(variable, raising=False)
    text = _plan(CASES[name]).describe() + "\n"
    path = GOLDEN / f"{name}.yaml"
    if os.environ.get("PREFECT_ACCELERATE_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text()


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_golden_manifest_validates_strictly_against_the_kubernetes_schema(name):
    documents = list(yaml.safe_load_all((GOLDEN / f"{name}.yaml").read_text()))
    assert [d["kind"] for d in documents] == ["Service", "Job"]
    for document in documents:
        kubernetes_validate.validate(document, K8S_VERSION, strict=True)


def test_the_strict_schema_check_catches_a_field_kubernetes_does_not_know():
    job = _documents(_plan(CASES["two-nodes-cpu"]))[1]
    job["spec"]["template"]["spec"]["containers"][0]["gpus"] = 8
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def test_the_job_is_indexed_fails_whole_on_any_pod_failure_and_names_pod_zero_for_the_rendezvous():
    plan = _plan(CASES["sixty-four-nodes-gpus"])
    service, job = _documents(plan)
    name = plan.request["job_name"]
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == ("Indexed", 64, 64, 0)
    assert spec["podFailurePolicy"]["rules"] == [{"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "NotIn", "values": [0]}}]
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == name and pod["restartPolicy"] == "Never"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    container = pod["containers"][0]
    rendezvous = f"{name}-0.{name}"
    assert container["command"][2] == "prefect_accelerate.launchers.engines.kubernetes.pod_entry"
    assert container["command"][container["command"].index("--wait-for") + 1] == rendezvous
    args = container["args"]
    assert args[args.index("--node_rank") + 1] == "$(JOB_COMPLETION_INDEX)"
    assert args[args.index("--rdzv_endpoint") + 1] == f"{rendezvous}:29400"
    assert args[args.index("--nproc_per_node") + 1] == "8" and args[args.index("--nnodes") + 1] == "64"
    assert args[-3:] == ["train.py", "--lr", "3e-4"]  # the script and its arguments unchanged
    assert container["resources"]["limits"] == {"cpu": "96", "memory": "1800Gi", "nvidia.com/gpu": "8"}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                  {"key": "dedicated", "operator": "Equal", "value": "training", "effect": "NoExecute"}]
    assert pod["serviceAccountName"] == "trainer" and pod["imagePullSecrets"] == [{"name": "registry-credentials"}]


def test_pods_get_the_environment_a_local_launch_of_the_same_flags_gets():
    from prefect_accelerate.launchers import plan_launch

    extra = ["--multi_gpu", "--mixed_precision", "bf16", "--dynamo_backend", "no", "--num_machines", "2", "--num_processes", "16",
             "--use_fsdp", "--fsdp_version", "2"]
    extra.remove("--multi_gpu")
    pod_env = {e["name"]: e["value"] for e in _documents(_plan([*extra, "--kubernetes_gpus_per_node", "8"]))[1]["spec"]["template"]["spec"]["containers"][0]["env"]}
    local_options = _options([*extra, "--machine_rank", "0", "--main_process_ip", "10.0.0.1"]).with_changes(kubernetes=False)
    local = plan_launch(local_options, StaticHost(kind="cuda", count=8, cores=2), cwd="/project")
    expected = {k: v for k, v in local.env.items() if k not in ("TORCHELASTIC_ERROR_FILE", "PYTHONUNBUFFERED")}
    assert {k: v for k, v in pod_env.items() if k != "PYTHONUNBUFFERED"} == expected
    assert expected["ACCELERATE_USE_FSDP"] == "true" and "ACCELERATE_USE_CPU" not in expected


def test_secrets_reach_the_pods_only_as_secret_key_references():
    job = _documents(_plan(CASES["sixty-four-nodes-gpus"]))[1]
    env = job["spec"]["template"]["spec"]["containers"][0]["env"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env if "valueFrom" in e}
    assert refs == {"HF_TOKEN": {"name": "hf-token", "key": "token"}, "WANDB_API_KEY": {"name": "wandb", "key": "api-key"}}
    assert all("value" not in e for e in env if e["name"] in refs)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(secret=st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126, blacklist_characters="'\"\\"), min_size=8, max_size=40),
       name=st.sampled_from(["HF_TOKEN", "WANDB_API_KEY", "MY_SERVICE_PASSWORD", "AWS_SECRET_ACCESS_KEY", "DB_CREDENTIAL"]))
def test_no_secret_value_of_this_environment_ever_lands_in_a_manifest(secret, name, monkeypatch):
    monkeypatch.delenv(name, raising=False)
    plain = _plan(CASES["two-nodes-cpu"])
    # a value the manifests hold anyway ("launcher", an image tag) says nothing about leaks: draw another
    assume(secret not in plain.describe() and secret not in plain.to_json())
    monkeypatch.setenv(name, secret)
    plan = _plan(CASES["two-nodes-cpu"])
    assert secret not in plan.describe() and secret not in plan.to_json()
    # passed as a script argument, it is refused instead of being written into the Job
    with pytest.raises(UsageError, match="holds the value of a secret variable"):
        _plan(CASES["two-nodes-cpu"], args=("--token", secret))


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


@settings(max_examples=300, deadline=None)
@given(script=st.text(min_size=1, max_size=120).filter(lambda s: "\x00" not in s), nodes=st.integers(min_value=1, max_value=65536),
       run_dir=st.text(min_size=1, max_size=40))
def test_job_names_are_dns_labels_and_every_pod_hostname_fits_63_characters(script, nodes, run_dir):
    name = kplan.job_name(script, run_dir, nodes)
    assert _DNS_LABEL.match(name) and _DNS_1035.match(name) and len(name) <= 63  # Job name, Service name (DNS-1035)
    last = f"{name}-{nodes - 1}"
    assert _DNS_LABEL.match(last) and len(last) <= 63  # the hostname of the last pod
    assert kplan.rendezvous_host(name) == f"{name}-0.{name}"


def test_a_long_script_name_is_shortened_but_keeps_the_run_folders_suffix():
    name = kplan.job_name("a_very_long_training_script_name_that_goes_on_and_on_and_on_forever.py", "/runs/r1", 65536)
    assert len(f"{name}-65535") == 63 and name.startswith("pa-a-very-long") and name.endswith(kplan.job_name("x.py", "/runs/r1", 1)[-6:])
    assert kplan.job_name("train.py", "/runs/r1", 2) != kplan.job_name("train.py", "/runs/r2", 2)


@pytest.mark.parametrize(("extra", "message"), [
    (["--kubernetes_memory_per_node", "64GB"], "--kubernetes_memory_per_node '64GB' is not valid: write it as a Kubernetes quantity"),
    (["--kubernetes_namespace", "ML_Team"], "--kubernetes_namespace 'ML_Team' is not valid"),
    (["--kubernetes_toleration", "gpu=yes:Sometimes"], "the effect is one of NoSchedule"),
    (["--kubernetes_secret_env", "HF_TOKEN=hf-token"], "write it as NAME=SECRET:KEY"),
    (["--kubernetes_node_selector", "zone"], "write it as KEY=VALUE"),
    (["--slurm"], "--slurm and --kubernetes both choose where the launch runs"),
    (["--use_deepspeed", "--deepspeed_multinode_launcher", "pdsh", "--num_machines", "2", "--num_processes", "2"], None),
])
def test_bad_values_are_refused_before_anything_is_submitted(extra, message):
    if message is None:
        pytest.importorskip("deepspeed")
        message = "use `standard`"
    with pytest.raises(UsageError, match=re.escape(message)):
        _plan(["--num_machines", "2", "--num_processes", "2", *extra] if "--num_machines" not in extra else extra)


def test_without_an_image_the_cli_says_how_to_give_one_and_exits_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "prefect_accelerate.cli.main", "launch", "--kubernetes", "--num_machines", "2",
                           "--num_processes", "2", "--cpu", "--dry-run", "train.py"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--kubernetes_image" in done.stderr and "KubernetesClusterBlock" in done.stderr


def test_dry_run_prints_yaml_documents_and_imports_neither_torch_nor_prefect(tmp_path):
    code = ("import sys; from prefect_accelerate.cli.main import main; "
            "rc = main(['launch', '--kubernetes', '--kubernetes-image', 'img:1', '--num_machines', '2', '--num_processes', '2', "
            "'--cpu', '--dry-run', 'train.py']); "
            "assert 'torch' not in sys.modules and 'prefect' not in sys.modules and 'kubernetes' not in sys.modules, 'heavy import'; sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    documents = list(yaml.safe_load_all(done.stdout))  # the script need not exist here: it lives in the image
    assert [d["kind"] for d in documents] == ["Service", "Job"]


def test_planning_twice_gives_the_same_plan_and_leaves_the_options_as_they_were():
    options = _options(CASES["two-nodes-cpu"])
    before = options.model_dump()
    first = kplan.plan(options, GPU8, cwd="/project", run_dir="/runs/r1")
    assert first == kplan.plan(options, GPU8, cwd="/project", run_dir="/runs/r1")
    assert options.model_dump() == before


def test_the_self_test_script_runs_as_its_module_in_the_pods():
    from prefect_accelerate.selftest import SCRIPT

    options = _options(CASES["two-nodes-cpu"], script=str(SCRIPT), args=())
    args = _documents(kplan.plan(options, GPU8, cwd="/project", run_dir="/runs/r1"))[1]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-2:] == ["--module", "prefect_accelerate.selftest.script"] and str(SCRIPT) not in args


def test_cpu_per_node_sets_the_threads_per_process_unless_given():
    def threads(extra):
        env = _documents(_plan(extra))[1]["spec"]["template"]["spec"]["containers"][0]["env"]
        return next(e["value"] for e in env if e["name"] == "OMP_NUM_THREADS")

    assert threads(CASES["two-nodes-cpu"]) == "2"  # 4 CPUs, 2 processes per pod
    assert threads([*CASES["two-nodes-cpu"], "--num_cpu_threads_per_process", "3"]) == "3"


def test_cluster_block_values_fill_in_what_flags_leave_out(monkeypatch):
    from prefect_accelerate.launchers.engines.kubernetes import block

    saved = {"image": "ghcr.io/acme/base:1", "namespace": "ml", "gpus_per_node": 4, "node_selector": {"pool": "a100"},
             "tolerations": ["nvidia.com/gpu:NoSchedule", {"key": "spot", "operator": "Exists"}], "secret_env": {"HF_TOKEN": "hf:token"}}
    monkeypatch.setattr(block, "load_cluster_block", lambda name: saved if name == "gpu" else {})
    parsed = build_parser().parse_args(["launch", "--kubernetes", "--kubernetes_block", "gpu", "--kubernetes_namespace", "other",
                                        "--multi_gpu", "--num_machines", "2", "--num_processes", "8", "--kubernetes_node_selector", "zone=b", "train.py"])
    plan = kplan.plan(options_from_namespace(parsed, host=GPU8, environ={}), GPU8, cwd="/project", run_dir="/runs/r1")
    service, job = _documents(plan)
    pod = job["spec"]["template"]["spec"]
    assert job["metadata"]["namespace"] == "other" and pod["containers"][0]["image"] == "ghcr.io/acme/base:1"
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "4"}
    assert pod["nodeSelector"] == {"pool": "a100", "zone": "b"}
    assert pod["tolerations"][1] == {"key": "spot", "operator": "Exists"}
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in pod["containers"][0]["env"]
    for document in (service, job):
        kubernetes_validate.validate(document, K8S_VERSION, strict=True)


def test_the_kubernetes_deployment_plans_an_indexed_job_over_two_pods_with_the_flow_pods_image(monkeypatch):
    from prefect_accelerate.flows.pipeline import launch_options
    from prefect_accelerate.pipeline.models import PipelineRequest

    # what deployments/kubernetes/base-job-template.json puts into the flow run's pod
    monkeypatch.setenv(kplan.IMAGE_ENV, "ghcr.io/acme/prefect-accelerate:1")
    monkeypatch.setenv(kplan.NAMESPACE_ENV, "ml")
    monkeypatch.setenv(kplan.OWNER_POD_ENV, "launch-training-abc12-x7k2p")
    monkeypatch.setenv(kplan.OWNER_UID_ENV, "5a1c2f0e-4b7d-4e0f-9f3a-2d6c8b1e7a90")

    spec = yaml.safe_load((REPO / "deployments" / "kubernetes" / "prefect.yaml").read_text())
    request = PipelineRequest.model_validate(next(d for d in spec["deployments"] if d["name"] == "kubernetes")["parameters"]["request"])
    plan = kplan.plan(launch_options(request), StaticHost(), cwd="/opt/prefect/prefect-accelerate", run_dir="/runs/r2")
    service, job = _documents(plan)
    assert plan.launcher == "kubernetes" and job["spec"]["completions"] == 2
    assert job["metadata"]["namespace"] == service["metadata"]["namespace"] == "ml"
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/acme/prefect-accelerate:1"
    # owned by the flow run's pod: Kubernetes deletes the training Job when that pod goes, however it went
    assert job["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Pod", "name": "launch-training-abc12-x7k2p",
                                                   "uid": "5a1c2f0e-4b7d-4e0f-9f3a-2d6c8b1e7a90"}]
    monkeypatch.setenv(kplan.NAMESPACE_ENV, "prefect")  # a pod in another namespace cannot own it
    elsewhere = _documents(kplan.plan(launch_options(request).with_changes(kubernetes_namespace="ml"), StaticHost(), cwd="/p", run_dir="/runs/r3"))[1]
    assert "ownerReferences" not in elsewhere["metadata"]
    for document in (service, job):
        kubernetes_validate.validate(document, K8S_VERSION, strict=True)


def test_deepspeed_standard_runs_in_every_pod_without_this_machines_pythonpath(monkeypatch):
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("PYTHONPATH", "/home/me/secret-project/src")
    plan = _plan(["--use_deepspeed", "--zero_stage", "2", "--mixed_precision", "no", "--dynamo_backend", "no",
                  "--deepspeed_multinode_launcher", "standard", "--num_machines", "2", "--num_processes", "4", "--kubernetes_gpus_per_node", "2"])
    service, job = _documents(plan)
    env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2"
    assert "PYTHONPATH" not in env and "/home/me" not in plan.describe()
    assert any("PYTHONPATH is left to the image" in note for note in plan.notes)
    for document in (service, job):
        kubernetes_validate.validate(document, K8S_VERSION, strict=True)
