"""TPU launches run for real against stand-ins: a `torch_xla` that records how it was called and spawns
the main function the way the real launcher does, and a `gcloud` that plays a pod of two workers on this
machine (tests/launchers/fakes). The real torch_xla cannot run here (it needs exactly torch 2.9.0), and
no real pod is reachable; test_tpu_gcloud_dry_run.py checks the gcloud commands with the real gcloud.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.processes import running

from prefect_accelerate.launchers import plan_launch
from prefect_accelerate.launchers.engines.tpu import plan as tpu_launcher
from prefect_accelerate.launchers.execute import execute
from prefect_accelerate.launchers.engines.tpu.gcloud import TpuPod
from prefect_accelerate.launchers.host import local_host
from prefect_accelerate.launchers.options import build_launch_options
from prefect_accelerate.launchers.engines.tpu.runner import bf16_env

FAKES = Path(__file__).resolve().parents[2] / "fakes"
TRAIN = FAKES / "tpu_train.py"
QUIET = dict(num_machines=1, dynamo_backend="no")


def records(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.exists() else []


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
def xla(tmp_path, monkeypatch):
    """The stand-in torch_xla on PYTHONPATH for the launched processes, and where they report."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKES / "xla"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(FAKES / "xla"))  # so the plan finds it too
    monkeypatch.setenv("FAKE_XLA_LOG", str(tmp_path / "xla.log"))
    monkeypatch.setenv("TPU_TRAIN_OUT", str(tmp_path / "out"))
    for name in ("FAKE_XLA_API", "FAKE_XLA_DEVICES", "FAKE_XLA_DEVICE_TYPE", "TPU_TRAIN_MODE", "XLA_USE_BF16", "XLA_DOWNCAST_BF16"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def launch(script, args=(), *, cwd, run_dir=None, timeout=120, **flags):
    options = build_launch_options(str(script), list(args), tpu=True, run_dir=str(run_dir or Path(cwd) / "run"), **QUIET, **flags)
    lines: list[tuple[str, str]] = []
    plan = plan_launch(options, cwd=str(cwd))
    return plan, execute(plan, on_line=lambda label, line: lines.append((label, line)), timeout=timeout), lines


def test_single_host_runs_the_main_function_once_per_device_through_torch_xla_launch(xla, monkeypatch):
    monkeypatch.setenv("FAKE_XLA_DEVICES", "2")
    _, result, lines = launch(TRAIN, ["--lr", "3e-4"], cwd=xla, debug=True)
    assert result.exit_code == 0, result.tail
    seen = records(xla / "out")
    assert len(seen) == 2
    for record in seen:
        assert record["argv"] == [str(TRAIN), "--lr", "3e-4"]
        assert record["env"]["FORK_LAUNCHED"] == "1" and record["env"]["ACCELERATE_DEBUG_MODE"] == "true"
    (call,) = calls(xla / "xla.log")
    assert call["call"] == "torch_xla.launch" and call["function"] == "MainFunction" and call["args"] == []
    assert any("training on worker" in line for _, line in lines)


def test_older_torch_xla_without_launch_goes_through_xla_multiprocessing_spawn(xla, monkeypatch):
    monkeypatch.setenv("FAKE_XLA_API", "spawn")
    _, result, _ = launch(TRAIN, cwd=xla)
    assert result.exit_code == 0, result.tail
    assert [c["call"] for c in calls(xla / "xla.log")] == ["xla_multiprocessing.spawn"]


def test_bf16_on_a_tpu_sets_xla_use_bf16_for_the_training_processes(xla, monkeypatch):
    monkeypatch.setenv("FAKE_XLA_DEVICE_TYPE", "TPU")
    _, result, _ = launch(TRAIN, cwd=xla, mixed_precision="bf16")
    assert result.exit_code == 0, result.tail
    (record,) = records(xla / "out")
    assert record["env"]["XLA_USE_BF16"] == "1" and record["env"]["XLA_DOWNCAST_BF16"] is None


@pytest.mark.parametrize(("mode", "tpu", "expected"), [
    ("use", True, {"XLA_USE_BF16": "1"}),
    ("downcast", True, {"XLA_DOWNCAST_BF16": "1"}),
    ("use", False, {}),  # on a CPU or GPU PJRT device nothing changes, as in Accelerate
    (None, True, {}),
])
def test_bf16_variables_follow_accelerates_rule(mode, tpu, expected):
    assert bf16_env(mode, tpu) == expected


def test_module_mode_imports_the_module_and_calls_the_named_function(xla):
    _, result, _ = launch("tpu_train", ["--x", "1"], cwd=FAKES, run_dir=xla / "run", module=True, main_training_function="other_entry")
    assert result.exit_code == 0, result.tail
    (record,) = records(xla / "out")
    assert record["argv"][1:] == ["--x", "1"] and record["argv"][0].endswith("tpu_train.py")


def test_a_script_without_the_main_function_exits_2_and_names_the_functions_it_has(xla):
    _, result, _ = launch(TRAIN, cwd=xla, main_training_function="nope")
    assert result.exit_code == 2
    assert any("has no function named 'nope'" in line and "main, other_entry" in line for line in result.tail)


def test_a_failing_training_function_fails_the_launch_with_its_exit_code(xla, monkeypatch):
    monkeypatch.setenv("TPU_TRAIN_MODE", "fail")
    _, result, _ = launch(TRAIN, cwd=xla)
    assert result.exit_code == 7 and not result.succeeded


def test_the_runner_without_torch_xla_says_which_extra_to_install(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "prefect_accelerate.launchers.engines.tpu.runner", "--", str(TRAIN)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "pip install 'prefect-accelerate[tpu]'" in done.stderr and "torch_xla" in done.stderr


# ------------------------------------------------------------------------------------------------
# Pods, through the fake gcloud (two workers on this machine, each with its own HOME)


@pytest.fixture
def pod(xla, monkeypatch):
    monkeypatch.setenv("PATH", os.pathsep.join([str(FAKES / "bin"), str(Path(sys.executable).parent), os.environ["PATH"]]))
    monkeypatch.setenv("FAKE_GCLOUD_LOG", str(xla / "gcloud.log"))
    monkeypatch.setenv("FAKE_TPU_ROOT", str(xla / "pod"))
    monkeypatch.setenv("FAKE_TPU_WORKERS", "2")
    monkeypatch.delenv("FAKE_GCLOUD_FAIL", raising=False)
    (xla / "train.py").write_text(TRAIN.read_text())
    return xla


def pod_launch(folder: Path, args=(), *, timeout=180, copy_script=True, **flags):
    options = build_launch_options("train.py", list(args), tpu=True, tpu_use_cluster=True, num_processes=8, mixed_precision="bf16",
                                   run_dir=str(folder / "run"), **QUIET, **flags)
    plan = tpu_launcher.plan(options, local_host(), cwd=str(folder), run_dir=str(folder / "run"),
                             pod=TpuPod(name="pod-1", zone="us-central2-b"), copy_script=copy_script)
    lines: list[tuple[str, str]] = []
    result = execute(plan, on_line=lambda label, line: lines.append((label, line)), timeout=timeout, grace=20)
    return plan, result, lines


def wait_gone(pids: list[int], timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if running(p)]
        time.sleep(0.2)
    return alive


@pytest.mark.slow
def test_pod_launch_copies_the_script_and_runs_it_on_every_worker_with_the_users_env(pod, monkeypatch):
    monkeypatch.setenv("FAKE_XLA_DEVICE_TYPE", "TPU")
    monkeypatch.setenv("FORWARDED", "from-this-machine")
    plan, result, lines = pod_launch(pod, ["--lr", "1"], env=["MY_FLAG=a b", "HF_TOKEN=hf_pod_secret", "FORWARDED"])
    assert result.exit_code == 0, result.tail
    steps = json.loads(plan.files[tpu_launcher.POD_SPEC_FILE])["steps"]
    assert [c["argv"] for c in calls(pod / "gcloud.log")] == steps  # scp, then ssh: exactly the plan's commands
    seen = sorted(records(pod / "out"), key=lambda r: r["worker"])
    assert [r["worker"] for r in seen] == ["0", "1"]
    for record in seen:
        assert record["cwd"] == str(pod / "pod" / "pod-1" / f"worker-{record['worker']}" / "prefect-accelerate-run")
        assert record["argv"][1:] == ["--lr", "1"]
        assert record["env"] | {"FROM_CONFIG": None} == {
            "XLA_USE_BF16": "1", "XLA_DOWNCAST_BF16": None, "ACCELERATE_DEBUG_MODE": None, "FORK_LAUNCHED": "1",
            "ACCELERATE_IN_TPU_POD": "1", "HF_TOKEN": "hf_pod_secret", "MY_FLAG": "a b", "FROM_CONFIG": None, "FORWARDED": "from-this-machine"}
    assert not list((pod / "pod").glob("*/*/prefect-accelerate-run/.env"))  # read, then removed on every worker
    everything = (pod / "gcloud.log").read_text() + Path(result.log_path).read_text() + result.model_dump_json() + json.dumps(lines)
    assert "hf_pod_secret" not in everything


@pytest.mark.slow
def test_a_failing_worker_fails_the_pod_launch_with_its_exit_code(pod, monkeypatch):
    monkeypatch.setenv("TPU_TRAIN_MODE", "fail")
    _, result, _ = pod_launch(pod, copy_script=False)
    assert result.exit_code == 7


def test_a_gcloud_failure_ends_the_pod_launch_with_gclouds_exit_code(pod, monkeypatch):
    monkeypatch.setenv("FAKE_GCLOUD_FAIL", "1")
    _, result, _ = pod_launch(pod, copy_script=False)
    assert result.exit_code == 1 and any("NOT_FOUND" in line for line in result.tail)


@pytest.mark.slow
def test_stopping_a_pod_launch_stops_the_processes_on_every_worker(pod, monkeypatch):
    monkeypatch.setenv("TPU_TRAIN_MODE", "sleep")
    started = time.monotonic()
    _, result, lines = pod_launch(pod, copy_script=False, timeout=10)
    assert result.timed_out and time.monotonic() - started < 60
    pids = [r["pid"] for r in records(pod / "out")]
    assert len(pids) == 2
    assert wait_gone(pids) == []  # the workers are detached: only the stop command can have ended them
    stop = calls(pod / "gcloud.log")[-1]["argv"]
    assert stop[4] == "ssh" and stop[-2:] == ["--worker", "all"] and stop[-3].startswith("kill -TERM $(cat ~/.cache/prefect-accelerate/tpu-pod-")
    assert not list((pod / "pod").glob("*/*/.cache/prefect-accelerate/*.pid"))
    assert any("stopping the launch on every worker" in line for _, line in lines)
