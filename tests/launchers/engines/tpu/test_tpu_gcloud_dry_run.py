"""The gcloud commands we build, given to the real gcloud (`--dry-run`) against a fake TPU API.

This runs inside `unshare -rn` (a network namespace with only loopback) with a scratch CLOUDSDK_CONFIG
and CLOUDSDK_CORE_CHECK_GCE_METADATA=false, so nothing can leave the machine. It shows that gcloud
accepts our argument order and turns `--worker all` into one ssh/scp per worker carrying our command
unchanged. Skipped where gcloud or unprivileged network namespaces are missing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prefect_accelerate.launchers.engines.tpu import plan as tpu_launcher
from prefect_accelerate.launchers.engines.tpu.gcloud import TpuPod
from prefect_accelerate.launchers.host import StaticHost
from prefect_accelerate.launchers.options import build_launch_options
from prefect_accelerate.tpu_config import resolve_tpu_config

FAKES = Path(__file__).resolve().parents[2] / "fakes"
HOST = StaticHost(python_path="PYTHON")

pytestmark = pytest.mark.slow


def _namespaces_work() -> bool:
    if not shutil.which("unshare") or not shutil.which("ip"):
        return False
    return subprocess.run(["unshare", "-rn", "ip", "link", "set", "lo", "up"], capture_output=True, timeout=30).returncode == 0


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    if not shutil.which("gcloud"):
        pytest.skip("gcloud is not installed")
    if not _namespaces_work():
        pytest.skip("unprivileged network namespaces (unshare -rn) are not available")

    def run(commands: list[list[str]]) -> dict:
        scratch = tmp_path_factory.mktemp("gcloud")
        (scratch / "home").mkdir()
        job = scratch / "job.json"
        job.write_text(json.dumps({"scratch": str(scratch), "commands": commands}))
        done = subprocess.run(["unshare", "-rn", sys.executable, str(FAKES / "gcloud_dry_run.py"), str(job), str(scratch / "out.json")],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return json.loads((scratch / "out.json").read_text())

    return run


def worker_lines(output: dict, program: str) -> list[str]:
    return [line for line in output["stdout"].splitlines() if line.startswith(f"/usr/bin/{program} ")]


def test_real_gcloud_accepts_the_pod_launch_and_stop_commands(dry_run, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    (tmp_path / "train.py").write_text("def main():\n    pass\n")
    options = build_launch_options("train.py", ["--lr", "1"], tpu=True, tpu_use_cluster=True, num_processes=8, num_machines=1,
                                   mixed_precision="bf16", dynamo_backend="no", env=["MY_FLAG=a b", "HF_TOKEN=x-secret"], host=HOST, environ={})
    plan = tpu_launcher.plan(options, HOST, cwd=str(tmp_path), run_dir=str(tmp_path / "run"),
                             pod=TpuPod(name="my-pod", zone="us-central2-b"), copy_script=True)
    spec = json.loads(plan.files[tpu_launcher.POD_SPEC_FILE])
    (scp, ssh), stop = spec["steps"], spec["stop"]
    result = dry_run([scp, ssh, stop])
    scp_out, ssh_out, stop_out = result["outputs"]
    for output in (scp_out, ssh_out, stop_out):
        assert output["code"] == 0, output["stderr"]
    copies = worker_lines(scp_out, "scp")
    assert len(copies) == 2 and all(line.startswith("/usr/bin/scp -r ") and line.endswith(f"{spec['stage']['dir']} root@127.0.1.{i}:~/")
                                    for line, i in zip(copies, (2, 3), strict=True))
    for output, command in ((ssh_out, ssh[ssh.index("--command") + 1]), (stop_out, stop[stop.index("--command") + 1])):
        lines = worker_lines(output, "ssh")
        assert len(lines) == 2, output
        assert all(line.endswith(f" -- {command}") for line in lines)  # our command reaches each worker unchanged
    assert any("/nodes/my-pod" in request for request in result["api"])


def test_real_gcloud_accepts_the_tpu_config_command(dry_run):
    request = resolve_tpu_config(tpu_name="my-pod", tpu_zone="us-central2-b", command=[["echo", "hello"], ["ls"]],
                                 install_accelerate=True, install_prefect_accelerate=True)
    (output,) = dry_run([request.argv()])["outputs"]
    assert output["code"] == 0, output["stderr"]
    lines = worker_lines(output, "ssh")
    assert len(lines) == 2
    assert all(line.endswith(" -- cd /usr/share; pip install accelerate -U; pip install prefect-accelerate -U; echo hello; ls") for line in lines)
