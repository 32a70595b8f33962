"""Kill `config update` at random points: the file is always the old or the new content, never partial."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from prefect_accelerate.config.update import update_config_file

DRIVER = Path(__file__).resolve().parent / "crash_writer.py"
RUNS = 20


def old_config() -> str:
    # an old-format file (fp16 flag, empty sections) with enough content that each write takes a while
    data = {
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "NO", "fp16": True, "fsdp_config": {},
        "main_process_ip": None, "tpu_name": "pod", "commands": [f"echo step {i} of the start-up script" for i in range(1500)],
    }
    return yaml.safe_dump(data)


def start(mode: str, path: Path, extra: list[str]) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, str(DRIVER), mode, str(path), *extra], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    return process


def kill_at_random(process: subprocess.Popen, latest: float, rng: random.Random) -> None:
    time.sleep(rng.uniform(0, latest))
    process.send_signal(signal.SIGKILL)
    process.wait()


def measure(mode: str, tmp_path: Path, extra: list[str]) -> float:
    path = tmp_path / "measure.yaml"
    path.write_text(old_config())
    began = time.monotonic()
    process = start(mode, path, extra)
    assert process.wait(timeout=120) == 0
    return time.monotonic() - began


@pytest.mark.slow
def test_killed_update_leaves_old_or_new_content(tmp_path):
    old = old_config()
    reference = tmp_path / "reference.yaml"
    reference.write_text(old)
    update_config_file(reference)
    new = reference.read_text()
    duration = measure("atomic", tmp_path, [])
    rng = random.Random(20261202)
    outcomes = {"old": 0, "new": 0}
    for run in range(RUNS):
        path = tmp_path / f"run{run}.yaml"
        path.write_text(old)
        # up to 1.5x the measured run time, so the kills also land after a finished write under load
        kill_at_random(start("atomic", path, []), duration * 1.5, rng)
        content = path.read_text()
        assert content in (old, new), f"run {run}: partial file of {len(content)} characters"
        outcomes["old" if content == old else "new"] += 1
        backup = path.with_name(path.name + ".bak")
        if backup.exists():
            # the backup is written atomically too; it exists only complete
            assert backup.read_text() == old
    # the kills spread over the whole run: some before the rename, some after
    assert outcomes["old"] > 0 and outcomes["new"] > 0, outcomes


@pytest.mark.slow
def test_the_same_kills_do_corrupt_a_naive_writer(tmp_path):
    """Control: the harness really interrupts writes, so the test above could fail."""
    old = old_config()
    reference = tmp_path / "reference.yaml"
    reference.write_text(old)
    update_config_file(reference)
    new = reference.read_text()
    new_file = tmp_path / "new.yaml"
    new_file.write_text(new)
    duration = measure("naive", tmp_path, [str(new_file)])
    rng = random.Random(7)
    partial = 0
    for run in range(15):
        path = tmp_path / f"naive{run}.yaml"
        path.write_text(old)
        kill_at_random(start("naive", path, [str(new_file)]), duration, rng)
        partial += path.read_text() not in (old, new)
    assert partial > 0
