"""TPU plans: single host through the runner module, pods through gcloud; every command shape pinned by a golden file.

Nothing runs here; test_tpu_run.py runs the same plans against a stand-in torch_xla and a fake gcloud.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from helpers.golden import assert_golden, normalize_plan

from prefect_accelerate.cli.main import build_parser
from prefect_accelerate.errors import DependencyError, UsageError
from prefect_accelerate.launchers import plan_launch
from prefect_accelerate.launchers.engines.tpu import plan as tpu_launcher
from prefect_accelerate.launchers.engines.tpu import gcloud
from prefect_accelerate.launchers.engines.tpu.gcloud import TpuPod, scp_argv, ssh_argv
from prefect_accelerate.launchers.host import StaticHost
from prefect_accelerate.launchers.options import build_launch_options, options_from_namespace

FAKES = Path(__file__).resolve().parents[2] / "fakes"
HOST = StaticHost(kind=None, count=0, cores=2, python_path="PYTHON")
BASE = ["--num_machines", "1", "--dynamo_backend", "no"]

POD_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: XLA
mixed_precision: 'no'
num_processes: 8
main_training_function: main
tpu_use_cluster: true
tpu_name: test-pod
tpu_zone: us-central2-b
tpu_use_sudo: false
tpu_env: ["FROM_CONFIG=yes", ""]
tpu_vm: [""]
downcast_bf16: 'no'
"""


@pytest.fixture
def stand_in_xla(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKES / "xla"))


@pytest.fixture(autouse=True)
def no_pod_block_from_env(monkeypatch):
    monkeypatch.delenv(gcloud.TPU_BLOCK_ENV, raising=False)
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")  # the plan adds it only when the caller's env lacks it


def plan_from_argv(argv, tmp_path, **plan_kwargs):
    run_dir = str(tmp_path / "run")
    args = build_parser().parse_args(["launch", "--run_dir", run_dir, *argv])
    options = options_from_namespace(args, host=HOST, environ={})
    if plan_kwargs:
        return tpu_launcher.plan(options, HOST, cwd=str(tmp_path), run_dir=run_dir, **plan_kwargs), run_dir
    return plan_launch(options, HOST, cwd=str(tmp_path)), run_dir


def golden_view(plan, run_dir, cwd) -> dict:
    data = normalize_plan(plan.to_json_dict(), run_dir=run_dir, cwd=cwd)
    if "files" in data:
        data["files"] = {k: json.loads(v.replace(run_dir, "RUN_DIR").replace(cwd, "CWD")) for k, v in data["files"].items()}
    data["notes"] = [n.replace(run_dir, "RUN_DIR").replace(cwd, "CWD") for n in plan.notes]
    data["warnings"] = list(plan.warnings)
    return data


def write_config(tmp_path, text=POD_CONFIG) -> str:
    path = tmp_path / "pod.yaml"
    path.write_text(text)
    return str(path)


SINGLE_CASES = {
    "single-host": ["--tpu", *BASE, "--mixed_precision", "no", "train.py", "--lr", "3e-4"],
    "single-host-bf16-module-debug": ["--tpu", *BASE, "--mixed_precision", "bf16", "--downcast_bf16", "--debug",
                                      "--main_training_function", "run", "-m", "pkg.train", "--epochs", "2"],
}


@pytest.mark.parametrize("name", sorted(SINGLE_CASES))
def test_single_host_plan_matches_golden_file(name, tmp_path, stand_in_xla):
    plan, run_dir = plan_from_argv(SINGLE_CASES[name], tmp_path)
    assert plan.launcher == "tpu"
    assert_golden(f"tpu/{name}", golden_view(plan, run_dir, str(tmp_path)))


def test_single_host_runs_the_runner_module_with_the_script_after_a_separator(tmp_path, stand_in_xla):
    plan, _ = plan_from_argv(["--tpu", *BASE, "train.py", "--lr", "1"], tmp_path)
    assert plan.argv == ("PYTHON", "-m", "prefect_accelerate.launchers.engines.tpu.runner", "--main_training_function", "main",
                         "--", "train.py", "--lr", "1")


def test_bf16_is_left_to_the_runner_which_can_ask_torch_xla_for_a_tpu(tmp_path, stand_in_xla):
    plan, _ = plan_from_argv(["--tpu", *BASE, "--mixed_precision", "bf16", "train.py"], tmp_path)
    assert ("--bf16", "use") == plan.argv[plan.argv.index("--bf16"):plan.argv.index("--bf16") + 2]
    assert "XLA_USE_BF16" not in plan.env and any("XLA_USE_BF16=1" in n for n in plan.notes)


def test_missing_torch_xla_is_a_dependency_error_naming_the_tpu_extra(tmp_path, monkeypatch):
    monkeypatch.setattr(tpu_launcher.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DependencyError, match=r"prefect-accelerate\[tpu\]"):
        plan_from_argv(["--tpu", *BASE, "train.py"], tmp_path)


def test_no_python_is_refused_for_tpu(tmp_path, stand_in_xla):
    with pytest.raises(UsageError, match="--no_python cannot be used with --tpu"):
        plan_from_argv(["--tpu", *BASE, "--no_python", "run.sh"], tmp_path)


def test_pod_plan_from_config_matches_golden_file(tmp_path):
    plan, run_dir = plan_from_argv(["--config_file", write_config(tmp_path), "train.py", "--lr", "1"], tmp_path)
    assert plan.launcher == "tpu-pod"
    assert_golden("tpu/pod-from-config", golden_view(plan, run_dir, str(tmp_path)))


def test_pod_plan_with_copy_secrets_sudo_alpha_and_project_matches_golden_file(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("def main():\n    pass\n")
    config = write_config(tmp_path, POD_CONFIG.replace("tpu_use_sudo: false", "tpu_use_sudo: true"))
    pod = TpuPod(name="big-pod", zone="us-central2-b", project="my-project", use_alpha=True, internal_ip=True)
    plan, run_dir = plan_from_argv(
        ["--config_file", config, "--mixed_precision", "bf16", "--downcast_bf16", "--env", "MY_FLAG=a b", "--env", "HF_TOKEN=hf_secret_value",
         "--env", "WANDB_API_KEY", "train.py", "--lr", "1"], tmp_path, pod=pod, copy_script=True)
    assert_golden("tpu/pod-copy-secrets-sudo", golden_view(plan, run_dir, str(tmp_path)))


def test_pod_secrets_never_appear_on_a_command_line_or_in_the_shown_plan(tmp_path):
    plan, _ = plan_from_argv(["--config_file", write_config(tmp_path), "--env", "HF_TOKEN=hf_secret_value", "train.py"], tmp_path)
    spec = json.loads(plan.files[tpu_launcher.POD_SPEC_FILE])
    assert "hf_secret_value" not in json.dumps(spec) and "hf_secret_value" not in " ".join(plan.argv)
    assert "hf_secret_value" not in plan.describe() and "hf_secret_value" not in plan.to_json()
    assert plan.env["HF_TOKEN"] == "hf_secret_value" and plan.is_secret("HF_TOKEN")
    assert spec["stage"]["forward_env"] == ["HF_TOKEN"]


def test_pod_keeps_user_env_and_config_tpu_env_where_accelerate_drops_them(tmp_path):
    plan, _ = plan_from_argv(["--config_file", write_config(tmp_path), "--env", "MY_FLAG=1", "--env", "FROM_CONFIG=flag", "train.py"], tmp_path)
    remote = json.loads(plan.files[tpu_launcher.POD_SPEC_FILE])["steps"][-1][-3]
    assert "exec env MY_FLAG=1 FROM_CONFIG=flag ACCELERATE_IN_TPU_POD=1 prefect-accelerate launch" in remote


def test_pod_workers_get_the_real_mixed_precision_where_accelerate_sends_no(tmp_path):
    plan, _ = plan_from_argv(["--config_file", write_config(tmp_path), "--mixed_precision", "bf16", "train.py"], tmp_path)
    remote = json.loads(plan.files[tpu_launcher.POD_SPEC_FILE])["steps"][-1][-3]
    assert "--mixed_precision bf16" in remote and "--tpu --no_tpu_cluster" in remote


def test_pod_without_a_name_or_zone_is_a_usage_error_naming_both_places(tmp_path):
    config = write_config(tmp_path, POD_CONFIG.replace("tpu_name: test-pod\n", "").replace("tpu_zone: us-central2-b\n", ""))
    with pytest.raises(UsageError, match=r"No name \(--tpu_name\) and no zone \(--tpu_zone\).*TpuPodBlock"):
        plan_from_argv(["--config_file", config, "train.py"], tmp_path)


def test_pod_location_can_come_from_a_prefect_block(tmp_path, monkeypatch):
    config = write_config(tmp_path, POD_CONFIG.replace("tpu_name: test-pod\n", "").replace("tpu_zone: us-central2-b\n", ""))
    monkeypatch.setattr(gcloud, "load_pod_block", lambda name: {"name": f"pod-of-{name}", "zone": "europe-west4-a", "project": "p1"})
    monkeypatch.setenv(gcloud.TPU_BLOCK_ENV, "team-pod")
    plan, _ = plan_from_argv(["--config_file", config, "train.py"], tmp_path)
    ssh = json.loads(plan.files[tpu_launcher.POD_SPEC_FILE])["steps"][-1]
    assert ssh[:9] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod-of-team-pod", "--zone", "europe-west4-a", "--project"]


def test_pod_rejects_a_malformed_env_entry(tmp_path):
    with pytest.raises(UsageError, match="not NAME=VALUE"):
        plan_from_argv(["--config_file", write_config(tmp_path), "--env", "1BAD=x", "train.py"], tmp_path)


def test_pod_warns_that_vm_groups_are_not_used(tmp_path):
    plan, _ = plan_from_argv(["--config_file", write_config(tmp_path), "--vm", "vm-1", "train.py"], tmp_path)
    assert any("vm-1" in w and "not used" in w for w in plan.warnings)


def test_planning_twice_gives_the_same_plan_and_leaves_the_options_alone(tmp_path):
    options = build_launch_options("train.py", ["--x", "1"], config_file=write_config(tmp_path), env=["A=1"], host=HOST, environ={})
    before = options.model_dump()
    first = tpu_launcher.plan(options, HOST, cwd=str(tmp_path), run_dir=str(tmp_path / "r"))
    second = tpu_launcher.plan(options, HOST, cwd=str(tmp_path), run_dir=str(tmp_path / "r"))
    assert first == second and options.model_dump() == before


def test_every_gcloud_command_shape_matches_the_golden_file():
    plain = TpuPod(name="pod", zone="us-central1-a")
    full = TpuPod(name="pod", zone="us-central1-a", project="proj", use_alpha=True, internal_ip=True)
    shapes = {
        "ssh": ssh_argv(plain, "cd /usr/share; ls"),
        "ssh-alpha-project-internal-ip": ssh_argv(full, "ls"),
        "ssh-one-worker": ssh_argv(plain, "hostname", worker="0"),
        "scp-file": scp_argv(plain, ["/tmp/train.py"], "~/"),
        "scp-folder-recurse": scp_argv(full, ["/tmp/stage"], "~/", recurse=True),
    }
    assert_golden("tpu/gcloud-commands", {name: shlex.join(argv) for name, argv in shapes.items()})


def test_pod_flags_alone_plan_a_pod_launch(tmp_path):
    """No config at all: --tpu --tpu_cluster with the pod's name, zone and project on the command line."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    plan, _ = plan_from_argv(["--tpu", "--tpu_cluster", "--tpu_name", "flag-pod", "--tpu_zone", "us-east5-a", "--tpu_project", "proj-1",
                              "--tpu_copy_script", *BASE, "--mixed_precision", "no", "train.py"], tmp_path)
    spec = json.loads(plan.files[tpu_launcher.POD_SPEC_FILE])
    ssh = spec["steps"][-1]
    assert ssh[:10] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "flag-pod", "--zone", "us-east5-a", "--project", "proj-1"]
    assert any(step[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"] for step in spec["steps"])  # the script is copied


@pytest.mark.usefixtures("prefect_harness")
def test_a_saved_pod_block_is_loaded_by_name(tmp_path):
    from prefect_accelerate.blocks import TpuPodBlock

    TpuPodBlock(tpu_name="block-pod", tpu_zone="europe-west4-a", project="blocks-project").save("saved-pod", overwrite=True)
    config = write_config(tmp_path, POD_CONFIG.replace("tpu_name: test-pod\n", "").replace("tpu_zone: us-central2-b\n", ""))
    plan, _ = plan_from_argv(["--config_file", config, "--tpu_block", "saved-pod", "train.py"], tmp_path)
    ssh = json.loads(plan.files[tpu_launcher.POD_SPEC_FILE])["steps"][-1]
    assert ssh[:10] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "block-pod", "--zone", "europe-west4-a", "--project", "blocks-project"]
    with pytest.raises(UsageError, match="Could not load the TPU pod block 'no-such-pod'.*Save one first"):
        plan_from_argv(["--config_file", config, "--tpu_block", "no-such-pod", "train.py"], tmp_path)
