"""`prefect flow-run cancel` on a running launch leaves no process behind: under a process worker and under serve.

A real `prefect server`, a real process worker (or a served flow) and a real torchrun with two workers
that write their pids; after the cancel the test polls until every one of them is gone.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
from helpers.prefect_server import running_server, wait_for_state
from helpers.processes import assert_all_gone, wait_for_pids

PROJECT = Path(__file__).resolve().parent / "cancel_project"
WORKER = str(Path(__file__).resolve().parents[1] / "launchers" / "scripts" / "worker.py")

pytestmark = pytest.mark.slow


def run_deployment(server, name: str, pid_dir: Path) -> str:
    done = server.cli("deployment", "run", name, "--param", f"pid_dir={pid_dir}", "--param", f"worker={WORKER}")
    match = re.search(r"UUID:\s*([0-9a-f-]{36})", done.stdout) or re.search(r"([0-9a-f]{8}-[0-9a-f-]{27})", done.stdout)
    assert match, done.stdout
    return match.group(1)


def test_cancel_under_a_process_worker_and_under_serve(tmp_path):
    with running_server(tmp_path / "prefect-home") as server:
        server.cli("work-pool", "create", "--type", "process", "cancel-pool")
        server.cli("deploy", "flows.py:sleepy_launch", "-n", "by-worker", "-p", "cancel-pool", cwd=str(PROJECT))
        server.start_worker("cancel-pool", tmp_path / "worker.log")
        server.start([sys.executable, "flows.py"], tmp_path / "serve.log", cwd=str(PROJECT))

        for deployment, folder in (("sleepy-launch/by-worker", "worker-pids"), ("sleepy-launch/served", "serve-pids")):
            pid_dir = tmp_path / folder
            pid_dir.mkdir()
            if deployment.endswith("served"):
                _wait_for_deployment(server, deployment)
            flow_run_id = run_deployment(server, deployment, pid_dir)
            pids = wait_for_pids(pid_dir, 2)
            wait_for_state(server, flow_run_id, {"RUNNING"})
            server.cli("flow-run", "cancel", flow_run_id)
            # the task's own cleanup: SIGTERM to torchrun, grace 10 s, then SIGKILL; well under Prefect's 30 s
            assert_all_gone(pids, timeout=45)
            assert wait_for_state(server, flow_run_id, {"CANCELLED", "CRASHED", "FAILED"}, timeout=120) == "CANCELLED"


def _wait_for_deployment(server, name: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.cli("deployment", "inspect", name, check=False).returncode == 0:
            return
        time.sleep(1)
    raise AssertionError(f"deployment {name} never appeared")
