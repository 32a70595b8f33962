"""Real gloo launches for issue 17: secrets never reach a run folder file, the failing rank's own exception
is the error, a stopped launch does not stream torchrun's SignalException, bad folders are one paragraph."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from prefect_accelerate.launchers import plan_launch
from prefect_accelerate.launchers.execute import execute
from prefect_accelerate.launchers.options import build_launch_options

CLI = [sys.executable, "-m", "prefect_accelerate.cli.main", "launch", "--no-track"]
QUIET = dict(mixed_precision="no", num_machines=1, dynamo_backend="no")
QUIET_FLAGS = ["--mixed_precision", "no", "--num_machines", "1", "--dynamo_backend", "no"]

SECRETS = {
    "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEY12345", "AWS_SECRET_ACCESS_KEY": "aws-secret-value-0123456789",
    "HF_TOKEN": "hf_exampletoken987654", "WANDB_API_KEY": "wandb-key-abcdef123456", "OPENAI_API_KEY": "sk-openai-example-777",
    "MY_SERVICE_SECRET": "service-secret-4242", "DB_PASSWORD": "db-password-31337",
}

PRINTER = """
import os, sys
names = {names!r}
for name in names:
    print(name, os.environ[name], flush=True)
    print(name, os.environ[name], file=sys.stderr, flush=True)
print("args", sys.argv[1:], flush=True)
"""

RAISER = """
import os, time

def load_batch(step):
    raise ValueError(f"batch {{step}} has no labels")

if os.environ["RANK"] == "1":
    load_batch(7)
time.sleep(20)
"""

pytestmark = pytest.mark.slow


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


def test_per_rank_logs_and_every_run_file_are_redacted_and_owner_only(tmp_path, monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    script = tmp_path / "printer.py"
    script.write_text(PRINTER.format(names=sorted(SECRETS)))
    run_dir = tmp_path / "run"
    options = build_launch_options(str(script), ["--tok", SECRETS["HF_TOKEN"]], cpu=True, num_processes=2, run_dir=str(run_dir), **QUIET)
    lines: list[str] = []
    result = execute(plan_launch(options), on_line=lambda label, line: lines.append(line))
    assert result.succeeded, result.failure_message()
    rank_logs = list(run_dir.glob("ranks/*/attempt_*/*/stdout.log"))
    assert len(rank_logs) == 2 and all("***" in p.read_text() for p in rank_logs)
    everything = "\n".join([*lines, result.command, *result.tail] + [p.read_text(errors="replace") for p in _files(run_dir)])
    leaked = [name for name, value in SECRETS.items() if value in everything]
    assert not leaked, f"secret values of {leaked} in the output or the run folder"
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in _files(run_dir))
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in run_dir.rglob("*") if p.is_dir())


def test_the_failing_ranks_own_exception_is_the_error(tmp_path):
    script = tmp_path / "raiser.py"
    script.write_text(RAISER.format())
    done = subprocess.run([*CLI, "--cpu", "--num_processes", "2", *QUIET_FLAGS, "--run_dir", str(tmp_path / "run"), str(script)],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)
    error = done.stderr.split("error:")[-1]
    assert done.returncode == 1, done.stderr
    assert "ValueError: batch 7 has no labels" in error
    assert f"at {script}, line 5, in load_batch" in error
    assert "Root Cause" not in error and "ChildFailedError" not in error and "error_file" not in error
    assert "Last lines: [default1]:" in error  # the worker's own closing lines


@pytest.mark.parametrize("blocker", ["run_dir", "state_dir"])
def test_a_run_or_state_folder_that_is_a_file_is_one_paragraph(tmp_path, blocker):
    script = tmp_path / "t.py"
    script.write_text("print('hi')\n")
    afile = tmp_path / "afile"
    afile.write_text("")
    env = dict(os.environ)
    argv = [*CLI, "--num_processes", "1", *QUIET_FLAGS]
    if blocker == "run_dir":
        argv += ["--run_dir", str(afile / "run")]
    else:
        env["PREFECT_ACCELERATE_STATE_DIR"] = str(afile)
    done = subprocess.run([*argv, str(script)], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and f"{afile} is a file, not a folder" in done.stderr


def test_state_records_are_readable_by_their_owner_only(tmp_path, monkeypatch):
    """The records a cancellation hook reads (pids, job ids, flow run ids) are no one else's business."""
    from prefect_accelerate.launchers.state import read_records, write_record

    monkeypatch.setenv("PREFECT_ACCELERATE_STATE_DIR", str(tmp_path / "state"))
    old = os.umask(0o022)  # a permissive umask must not widen them
    try:
        path = write_record("launches", "r1", {"flow_run_id": "f1", "pids": [1]})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert [r["pids"] for r in read_records("launches", "f1")] == [[1]]
