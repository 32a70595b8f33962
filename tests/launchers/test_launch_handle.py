"""A launch started before anyone waits on it (`start_plan`, what a tracked CLI launch does before its Prefect run
exists): real torchrun with sleeping workers on CPU."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from helpers.processes import assert_all_gone, wait_for_pids

from prefect_accelerate.launchers import plan_launch
from prefect_accelerate.launchers.options import build_launch_options
from prefect_accelerate.launchers.process import start_plan
from prefect_accelerate.launchers.state import launches_dir

pytestmark = pytest.mark.slow
WORKER = str(Path(__file__).resolve().parent / "scripts" / "worker.py")


def sleeping_plan(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("WORKER_MODE", "sleep")
    monkeypatch.setenv("WORKER_PID_DIR", str(tmp_path / "pids"))
    (tmp_path / "pids").mkdir()
    # port 0: a free port of its own (the handle is waited on directly, without execute's retry when the default 29500
    # is taken by a launch running beside it)
    options = build_launch_options(WORKER, cpu=True, num_processes=2, mixed_precision="no", num_machines=1, dynamo_backend="no",
                                   main_process_port=0, run_dir=str(tmp_path / "run"))
    return plan_launch(options)


def test_a_started_launch_nobody_waits_for_is_stopped_whole_and_its_state_file_names_the_run_that_adopted_it(tmp_path, monkeypatch):
    handle = start_plan(sleeping_plan(tmp_path, monkeypatch))
    try:
        workers = wait_for_pids(tmp_path / "pids", 2)
        assert handle.running()
        handle.record_run("flow-run-id", "task-run-id")  # what the adopting launch task does
        state = json.loads((launches_dir() / f"{handle.launch_id}.json").read_text())
        assert (state["flow_run_id"], state["task_run_id"], state["pgid"]) == ("flow-run-id", "task-run-id", handle.pid)
    finally:
        handle.stop(grace=5)
    handle.stop(grace=5)  # a second stop does nothing
    assert not handle.running()
    assert_all_gone([*workers, handle.pid])
    assert not (launches_dir() / f"{handle.launch_id}.json").exists()


def test_the_deadline_of_a_started_launch_counts_from_its_start_not_from_the_wait(tmp_path, monkeypatch):
    handle = start_plan(sleeping_plan(tmp_path, monkeypatch))
    try:
        workers = wait_for_pids(tmp_path / "pids", 2)
        time.sleep(max(0.0, 7.0 - (time.monotonic() - handle.started)))  # the 6 s deadline has passed
        waiting = time.monotonic()
        result = handle.wait(timeout=6, grace=3)
        waited = time.monotonic() - waiting
    finally:
        handle.stop(grace=3)
    assert result.timed_out and result.exit_code == 124 and result.duration_s >= 6
    assert waited < 6, f"waited {waited:.1f} s: the deadline was counted from the wait"
    assert_all_gone(workers)
