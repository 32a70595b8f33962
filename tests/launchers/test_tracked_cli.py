"""`prefect-accelerate launch` tracked (its default), as a user runs it: the CLI process runs the launch
flow against a Prefect API (here the session's test server), and keeps the untracked path's promises:
the worker's exit code. (SIGTERM, Ctrl-C and a deadline on a tracked launch: tests/cli/test_local_server.py,
which also checks the flow run's final state and that no process is left.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.processes import assert_all_gone, read_pids

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness")]
WORKER = str(Path(__file__).resolve().parent / "scripts" / "worker.py")
CLI = [sys.executable, "-m", "prefect_accelerate.cli.main", "launch", "--track", "--cpu", "--num_processes", "2",
       "--mixed_precision", "no", "--num_machines", "1", "--dynamo_backend", "no"]


def tracked_env(tmp_path: Path, mode: str) -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    pids = tmp_path / "pids"
    pids.mkdir(exist_ok=True)
    return {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "WORKER_MODE": mode, "WORKER_PID_DIR": str(pids)}


def test_a_failing_rank_gives_its_exit_code_through_the_flow(tmp_path):
    done = subprocess.run([*CLI, WORKER], env=tracked_env(tmp_path, "fail_rank1"), capture_output=True, text=True, timeout=240)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "rank 1 exited with code 3" in done.stderr
    assert "Traceback (most recent call last)" not in done.stderr.split("error:")[-1]
    assert_all_gone(read_pids(tmp_path / "pids"))
