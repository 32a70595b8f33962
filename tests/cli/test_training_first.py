"""A tracked launch never makes the training wait for Prefect: real `prefect-accelerate launch` commands, real
torchrun, real Prefect servers.

- The training's lines reach the console before Prefect is even imported (the import is held back until the
  console has shown them), and the lines printed before the flow run existed reach its logs afterwards, in
  order, with their rank labels and the times they were printed.
- The first call in a fresh PREFECT_HOME starts the training at once while the local server starts, and
  attaches the run when the server answers; when the training ends first, the command ends with it, untracked.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers.processes import assert_all_gone, end_group, wait_for_pids
from prefect_accelerate import localserver

pytestmark = pytest.mark.slow
GATE = str(Path(__file__).resolve().parent / "scripts" / "prefect_gate.py")
WORKER = str(Path(__file__).resolve().parent.parent / "launchers" / "scripts" / "worker.py")
QUIET = ["--cpu", "--num_processes", "2", "--mixed_precision", "no", "--num_machines", "1", "--dynamo_backend", "no"]
LAUNCH = [sys.executable, "-m", "prefect_accelerate.cli.main", "launch", *QUIET]

# prints 3 lines at once, then one every 0.3 s for `late` more
STEPS = """\
import os, sys, time
rank = os.environ["RANK"]
for step in range(3):
    print(f"early {step} of rank {rank}", flush=True)
for step in range(int(sys.argv[1])):
    time.sleep(0.3)
    print(f"late {step} of rank {rank}", flush=True)
"""

# reports whether the local server of PREFECT_HOME answered when the training started, then runs until it does
UNTIL_SERVER = """\
import json, os, sys, time
from pathlib import Path

rank = os.environ["RANK"]
record = Path(os.environ["PREFECT_HOME"], "prefect-accelerate", "server.json")

def ready():
    try:
        return json.loads(record.read_text()).get("state") == "ready"
    except (OSError, ValueError):
        return False

print(f"rank {rank} started; server ready: {ready()}", flush=True)
deadline = time.monotonic() + float(sys.argv[1])
while not ready() and time.monotonic() < deadline:
    time.sleep(0.1)
for step in range(10):
    print(f"rank {rank} after the server answered, step {step}", flush=True)
    time.sleep(0.5)
"""


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def env_for(home: Path, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_ACCELERATE_TRACK")}
    env.update(PREFECT_HOME=str(home), PREFECT_ACCELERATE_STATE_DIR=str(tmp_path / "state"), COLUMNS="200", **extra)
    return env


def flow_runs_named(url: str, name: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def read():
        async with get_client() as client:
            return await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))

    with temporary_settings(updates={PREFECT_API_URL: url}):
        return asyncio.run(read())


def run_logs(url: str, flow_run_id, expected: str, timeout: float = 60) -> list:
    """The run's log records, oldest first, once `expected` is among them (logs arrive in batches)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.monotonic() + timeout
    while True:
        with temporary_settings(updates={PREFECT_API_URL: url}), get_client(sync_client=True) as client:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), sort=LogSort.TIMESTAMP_ASC)
        if any(expected in log.message for log in logs) or time.monotonic() > deadline:
            return logs
        time.sleep(0.5)


def rank_lines(messages: list[str], pattern: str) -> dict[str, list[str]]:
    """Per rank label, the training lines among `messages` (in their order), checking each label is its rank's."""
    found: dict[str, list[str]] = {}
    for message in messages:
        match = re.fullmatch(rf"\[rank (\d)\] ({pattern})", message)
        if match:
            assert match.group(2).endswith(f"rank {match.group(1)}") or f"rank {match.group(1)} " in match.group(2), message
            found.setdefault(match.group(1), []).append(match.group(2))
    return found


def test_the_training_prints_before_prefect_is_imported_and_its_early_lines_reach_the_run_in_order(prefect_harness, session_root, tmp_path):
    script = tmp_path / "gated_steps.py"
    script.write_text(STEPS)
    record = tmp_path / "gate.json"
    env = env_for(session_root / "prefect-home", tmp_path, GATE_LINE="[rank 0] early 2 of rank 0|[rank 1] early 2 of rank 1", GATE_RECORD=str(record),
                  GATE_TIMEOUT="180")
    done = subprocess.run([sys.executable, GATE, "launch", *QUIET, "--run_dir", str(tmp_path / "run"), str(script), "8"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    gate = json.loads(record.read_text())
    assert gate["waited"], "Prefect was imported before the training's lines reached the console"
    for rank in "01":
        for line in [*(f"early {s} of rank {rank}" for s in range(3)), *(f"late {s} of rank {rank}" for s in range(8))]:
            assert f"[rank {rank}] {line}\n" in done.stdout, (line, done.stdout[-2000:])

    (run,) = flow_runs_named(prefect_harness.url, "launch-torchrun-gated_steps.py")
    assert run.state.is_completed()
    logs = run_logs(prefect_harness.url, run.id, "late 7 of rank 1")
    expected = {rank: [*(f"early {s} of rank {rank}" for s in range(3)), *(f"late {s} of rank {rank}" for s in range(8))] for rank in "01"}
    assert rank_lines([log.message for log in logs], r"(early|late) \d of rank \d") == expected  # each once, in order
    # printed before Prefect was imported, so before the run existed: logged with the time they were printed
    early = [log for log in logs if " early " in log.message]
    times = ([log.timestamp.timestamp() for log in early], gate["at"], run.created.timestamp())
    assert len(early) == 6 and all(log.timestamp.timestamp() < gate["at"] <= run.created.timestamp() for log in early), times
    assert all(log.task_run_id is not None for log in early)  # the launch task's lines, as every other line of the training


@pytest.fixture
def fresh_home(tmp_path):
    home = tmp_path / "prefect-home"
    yield home
    localserver.stop_server(home)


def test_the_first_call_starts_the_training_at_once_and_attaches_when_the_server_answers(fresh_home, tmp_path):
    script = tmp_path / "until_server.py"
    script.write_text(UNTIL_SERVER)
    # a port of its own: a port race on the default one would end this first training early and retry it untracked
    done = subprocess.run([*LAUNCH, "--main_process_port", str(free_port()), str(script), "600"], env=env_for(fresh_home, tmp_path),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    # the training ran before the server answered, and the run was still recorded
    assert "[rank 0] rank 0 started; server ready: False" in done.stdout, done.stdout[-2000:]
    assert "Started a local Prefect server" in done.stderr, done.stderr[-3000:]
    record = localserver.read_record(fresh_home)
    assert record is not None and record.state == "ready"
    (run,) = flow_runs_named(record.url, "launch-torchrun-until_server.py")
    assert run.state.is_completed()
    logs = run_logs(record.url, run.id, "rank 1 after the server answered, step 9")
    lines = rank_lines([log.message for log in logs], r"rank \d .*")
    for rank in "01":
        assert lines[rank] == [f"rank {rank} started; server ready: False",
                               *(f"rank {rank} after the server answered, step {s}" for s in range(10))]


def test_a_first_call_whose_training_ends_before_the_server_answers_ends_with_it_untracked(fresh_home, tmp_path):
    script = tmp_path / "short.py"
    script.write_text(STEPS)
    done = subprocess.run([*LAUNCH, str(script), "0"], env=env_for(fresh_home, tmp_path), capture_output=True, text=True, timeout=600)
    after = localserver.read_record(fresh_home)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[rank 1] early 2 of rank 1" in done.stdout
    if after is not None and after.state == "ready":
        pytest.skip("the local server answered before this short training ended (an unusually fast start)")
    # the command did not wait for the server: it is still starting, and says this launch is not recorded
    assert "the training ended before the local Prefect server answered" in done.stderr, done.stderr[-3000:]
    assert "not recorded in Prefect" in done.stderr and "Traceback" not in done.stderr
    assert after is not None and after.state == "starting" and localserver.is_running(after)


@pytest.mark.parametrize(("sent", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stop_before_the_run_exists_ends_the_training_already_running(prefect_harness, session_root, tmp_path, sent, code):
    """Prefect's import is held back for good: the training runs, no run exists yet, and Ctrl-C (to the group,
    as a terminal sends it) or SIGTERM ends the command with its code and leaves no process behind."""
    pids = tmp_path / "pids"
    pids.mkdir()
    env = env_for(session_root / "prefect-home", tmp_path, GATE_LINE="a line nobody prints", GATE_RECORD=str(tmp_path / "gate.json"),
                  GATE_TIMEOUT="600", WORKER_MODE="sleep", WORKER_PID_DIR=str(pids))
    known = {run.id for run in flow_runs_named(prefect_harness.url, "launch-torchrun-worker.py")}
    cli = subprocess.Popen([sys.executable, GATE, "launch", *QUIET, "--grace_period", "5", WORKER], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        workers = wait_for_pids(pids, 2)
        tree = [p.pid for p in psutil.Process(cli.pid).children(recursive=True)]
        if sent == signal.SIGINT:
            os.killpg(cli.pid, signal.SIGINT)
        else:
            cli.send_signal(signal.SIGTERM)
        out, err = cli.communicate(timeout=120)
    finally:
        end_group(cli)
    assert cli.returncode == code, err[-3000:]
    assert "every process the command started was stopped" in err and "Traceback" not in err, err[-3000:]
    assert "[rank 0] rank 0 sleeping" in out and "[rank 1] rank 1 sleeping" in out
    assert_all_gone([*workers, *tree], timeout=30)
    assert {run.id for run in flow_runs_named(prefect_harness.url, "launch-torchrun-worker.py")} == known  # none was created
