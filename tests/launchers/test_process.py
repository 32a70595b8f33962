"""Real launches on this machine: gloo process groups, two "nodes" on 127.0.0.1, failures, signals, deadlines.

Every worker writes its pid to a file; after each stop the test polls until all of them are gone.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers.processes import assert_all_gone, read_pids, wait_for_pids

from prefect_accelerate.launchers import plan_launch
from prefect_accelerate.launchers.execute import execute
from prefect_accelerate.launchers.options import build_launch_options
from prefect_accelerate.launchers.process import split_rank

REPO = Path(__file__).resolve().parents[2]
WORKER = str(REPO / "tests" / "launchers" / "scripts" / "worker.py")
CLI = [sys.executable, "-m", "prefect_accelerate.cli.main", "launch", "--no-track"]
QUIET = ["--mixed_precision", "no", "--num_machines", "1", "--dynamo_backend", "no"]

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env(tmp_path: Path, mode: str, **extra: str) -> dict[str, str]:
    pids = tmp_path / "pids"
    pids.mkdir(exist_ok=True)
    return {**os.environ, "WORKER_MODE": mode, "WORKER_PID_DIR": str(pids), **extra}


def test_two_process_gloo_job_all_reduces(tmp_path):
    done = subprocess.run([*CLI, "--cpu", "--num_processes", "2", *QUIET, WORKER], env=worker_env(tmp_path, "allreduce"),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "[rank 0] rank 0 of 2 sum 3.0" in done.stdout
    assert "[rank 1] rank 1 of 2 sum 3.0" in done.stdout


def test_output_lines_reach_the_callback_with_rank_labels(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKER_MODE", "allreduce")
    options = build_launch_options(WORKER, cpu=True, num_processes=2, mixed_precision="no", num_machines=1, dynamo_backend="no", run_dir=str(tmp_path / "run"))
    seen: list[tuple[str, str]] = []
    result = execute(plan_launch(options), on_line=lambda label, line: seen.append((label, line)))
    assert result.succeeded and result.exit_code == 0
    assert ("rank 0", "rank 0 of 2 sum 3.0") in seen and ("rank 1", "rank 1 of 2 sum 3.0") in seen
    assert "rank 1 of 2 sum 3.0" in Path(result.log_path).read_text()
    assert (tmp_path / "run" / "ranks").is_dir()  # per-rank logs kept with the run


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_two_nodes_on_loopback_reach_world_size_four(tmp_path, rendezvous):
    port = free_port()
    common = ["--cpu", "--num_processes", "4", "--num_machines", "2", "--main_process_ip", "127.0.0.1",
              "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no",
              "--rdzv_conf", "join_timeout=90,timeout=90"]
    common += ["--same_network"] if rendezvous == "static" else ["--rdzv_backend", "c10d"]
    env = worker_env(tmp_path, "allreduce")
    nodes = [subprocess.Popen([*CLI, *common, "--machine_rank", str(rank), WORKER], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=240) for node in nodes]
    for node, (out, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err
    text = outputs[0][0] + outputs[1][0]
    for rank in range(4):
        assert f"rank {rank} of 4 sum 10.0" in text


def test_a_failing_rank_is_named_with_its_exit_code(tmp_path):
    done = subprocess.run([*CLI, "--cpu", "--num_processes", "2", *QUIET, WORKER], env=worker_env(tmp_path, "fail_rank1"),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 3
    assert "rank 1 exited with code 3" in done.stderr
    assert "Traceback (most recent call last)" not in done.stderr.split("error:")[-1]
    assert "Last lines:" in done.stderr.split("error:")[-1]
    assert_all_gone(read_pids(tmp_path / "pids"))
    quiet = subprocess.run([*CLI, "-q", "--cpu", "--num_processes", "2", *QUIET, WORKER], env=worker_env(tmp_path, "fail_rank1"),
                           capture_output=True, text=True, timeout=180)
    assert quiet.returncode == 3 and "rank 1 exited with code 3" in quiet.stderr
    assert "Last lines:" not in quiet.stderr.split("error:")[-1]  # --quiet: the one-line error only


def test_a_raising_rank_reports_its_error_message(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKER_MODE", "raise_rank1")
    options = build_launch_options(WORKER, cpu=True, num_processes=2, mixed_precision="no", num_machines=1, dynamo_backend="no")
    result = execute(plan_launch(options))
    assert not result.succeeded and result.failed_ranks[0].rank == 1
    assert "rank 1 deliberate failure" in (result.error or "")
    with pytest.raises(Exception, match="rank 1 exited with code 1"):
        result.raise_for_failure()


@pytest.mark.parametrize("how", ["sigterm", "sigint"])
def test_stopping_the_cli_leaves_no_process_behind(tmp_path, how):
    # SIGINT as a terminal gives it, also when the suite itself runs with SIGINT ignored (started in the background)
    cli = subprocess.Popen([*CLI, "--cpu", "--num_processes", "2", *QUIET, WORKER], env=worker_env(tmp_path, "sleep"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pids = wait_for_pids(tmp_path / "pids", 2)
    launcher = [p.pid for p in psutil.Process(cli.pid).children()]
    cli.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGINT)
    _, err = cli.communicate(timeout=60)
    assert cli.returncode == (143 if how == "sigterm" else 130), err
    assert "SignalException" not in err, err[-3000:]  # torchrun's stop traceback stays in the log file
    assert_all_gone(pids + launcher)


def test_the_deadline_stops_the_launch_and_all_workers(tmp_path):
    began = time.monotonic()
    done = subprocess.run([*CLI, "--cpu", "--num_processes", "2", "--timeout", "12", "--grace_period", "5", *QUIET, WORKER],
                          env=worker_env(tmp_path, "sleep"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 124, done.stderr
    assert "deadline" in done.stderr
    assert "SignalException" not in done.stdout + done.stderr  # torchrun's stop traceback stays in the log file
    assert time.monotonic() - began < 60
    pids = read_pids(tmp_path / "pids")
    assert len(pids) == 2  # both workers had started before the deadline
    assert_all_gone(pids)


def test_workers_ignoring_sigterm_and_their_own_sessions_are_killed_after_the_grace(tmp_path):
    """torchrun's SIGTERM reaches nothing here: the launcher's SIGKILL of every descendant it saw must."""
    began = time.monotonic()
    done = subprocess.run([*CLI, "--cpu", "--num_processes", "2", "--timeout", "10", "--grace_period", "2", *QUIET, WORKER],
                          env=worker_env(tmp_path, "stubborn"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 124, done.stderr
    pids = read_pids(tmp_path / "pids")
    assert len(pids) == 4  # two workers and their two grandchildren (each in a session of its own)
    assert_all_gone(pids, timeout=10)
    assert time.monotonic() - began < 40


def test_secret_values_in_output_are_redacted_everywhere(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKER_MODE", "print_token")
    monkeypatch.setenv("HF_TOKEN", "hf_secretvalue123456")
    lines: list[str] = []
    options = build_launch_options(WORKER, cpu=True, num_processes=2, mixed_precision="no", num_machines=1, dynamo_backend="no")
    result = execute(plan_launch(options), on_line=lambda label, line: lines.append(line))
    assert result.succeeded
    text = "\n".join(lines)
    assert "token ***" in text and "hf_secretvalue123456" not in text
    log = Path(result.log_path).read_text()
    assert "token ***" in log and "hf_secretvalue123456" not in log
    assert "hf_secretvalue123456" not in "\n".join(result.tail)


def test_simple_launcher_runs_one_process_and_passes_its_exit_code(tmp_path):
    script = tmp_path / "exit7.py"
    script.write_text("import os, sys\nprint('simple', os.environ['ACCELERATE_MIXED_PRECISION'], flush=True)\nsys.exit(7)\n")
    done = subprocess.run([*CLI, "--num_processes", "1", "--mixed_precision", "bf16", str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 7
    assert "simple bf16" in done.stdout
    assert "exited with code 7" in done.stderr


def test_split_rank_reads_torchrun_prefixes():
    assert split_rank("[default3]:hello", "torchrun") == ("rank 3", "hello")
    assert split_rank("[trainer12]:x: y", "torchrun") == ("rank 12", "x: y")
    assert split_rank("plain line", "torchrun") == ("torchrun", "plain line")


def test_a_default_port_taken_after_planning_is_retried_on_a_free_port(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKER_MODE", "allreduce")
    options = build_launch_options(WORKER, cpu=True, num_processes=2, mixed_precision="no", num_machines=1, dynamo_backend="no")
    plan = plan_launch(options)
    with socket.socket() as squatter:  # someone takes the port between planning and launching
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        argv = list(plan.argv)
        argv[argv.index("--master_port") + 1] = str(taken)
        plan = plan.model_copy(update={"argv": tuple(argv)})
        assert plan.implicit_port
        lines: list[str] = []
        result = execute(plan, on_line=lambda label, line: lines.append(line))
    assert result.succeeded, result.tail
    assert any(f"port {taken} was taken meanwhile" in line for line in lines)


def test_rank_labels_are_global_on_the_second_machine():
    assert split_rank("[default1]:hi", "torchrun", first_rank=2) == ("rank 3", "hi")


def test_mpirun_hostfile_runs_every_rank_through_mpirun(tmp_path):
    """Open MPI's flags end to end with a stand-in mpirun (no MPI can be installed here)."""
    fake_bin = REPO / "tests" / "launchers" / "fakes" / "mpibin"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    config = tmp_path / "mpi.yaml"
    config.write_text(f"distributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: 2\nnum_machines: 1\nmixed_precision: 'no'\n"
                      f"mpirun_config:\n  mpirun_hostfile: {hostfile}\n")
    script = tmp_path / "mpi_rank.py"
    # one write per line: print() with several arguments writes them piece by piece, and the two ranks share
    # one pipe, so their pieces could interleave
    script.write_text("import os, sys\nsys.stdout.write(' '.join(['mpi rank', os.environ['OMPI_COMM_WORLD_RANK'], 'of',"
                      " os.environ['OMPI_COMM_WORLD_SIZE'], 'master', os.environ['MASTER_ADDR'],"
                      " os.environ['ACCELERATE_USE_CPU']]) + '\\n')\nsys.stdout.flush()\n")
    log = tmp_path / "mpirun.log"
    env = {**os.environ, "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}", "FAKE_MPIRUN_LOG": str(log)}
    done = subprocess.run([*CLI, "--config_file", str(config), "--dynamo_backend", "no", str(script)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "mpi rank 0 of 2 master 127.0.0.1 True" in done.stdout and "mpi rank 1 of 2 master 127.0.0.1 True" in done.stdout
    recorded = json.loads(log.read_text().splitlines()[0])
    assert recorded[:8] == ["--hostfile", str(hostfile), "--npernode", "2", "-n", "2", "--bind-to", "socket"]
    assert recorded[8:] == [sys.executable, str(script)]


def test_the_state_file_lets_a_hook_end_a_launch_whose_launcher_was_killed(tmp_path, monkeypatch):
    """SIGKILL of our launcher together with its watchdog (what an OOM kill of the whole cgroup or a hard node
    agent does) leaves what ignores torchrun's SIGTERM running; the state file it wrote is what the flow's
    on_cancellation/on_crashed hook uses to end them."""
    from prefect_accelerate.launchers.state import STATE_ENV, end_recorded_launches, launches_dir

    state = tmp_path / "state"
    monkeypatch.setenv(STATE_ENV, str(state))
    cli = subprocess.Popen([*CLI, "--cpu", "--num_processes", "2", *QUIET, WORKER], env=worker_env(tmp_path, "stubborn"),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids = wait_for_pids(tmp_path / "pids", 4)
    records = list(launches_dir().glob("*.json"))
    assert len(records) == 1
    deadline = time.monotonic() + 30
    while len(json.loads(records[0].read_text())["processes"]) < 5 and time.monotonic() < deadline:
        time.sleep(0.2)  # torchrun, two workers, two grandchildren: all recorded
    for child in psutil.Process(cli.pid).children():
        if "launchers.watchdog" in " ".join(child.cmdline()):
            child.kill()
    cli.kill()
    cli.wait(timeout=30)
    time.sleep(1)
    assert all(psutil.pid_exists(pid) for pid in pids)  # orphaned: they ignore the SIGTERM torchrun got
    signalled = end_recorded_launches(grace=2)
    assert signalled and not records[0].exists()
    assert_all_gone(pids, timeout=30)
    assert end_recorded_launches() == []  # idempotent


def test_a_recycled_pid_in_a_state_file_is_left_alone(tmp_path, monkeypatch):
    from prefect_accelerate.launchers.state import STATE_ENV, end_recorded_launches, write_state

    monkeypatch.setenv(STATE_ENV, str(tmp_path / "state"))
    me = psutil.Process()
    path = write_state("old-launch", {"processes": [{"pid": me.pid, "create_time": me.create_time() - 100.0}]})
    assert end_recorded_launches(grace=1) == []  # same pid, other start time: not ours to signal
    assert not path.exists()


@pytest.mark.parametrize("user_log_dir", [False, True])
def test_no_torchelastic_folder_is_left_in_tmpdir(tmp_path, user_log_dir):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    extra = ["--log_dir", str(tmp_path / "logs")] if user_log_dir else []
    done = subprocess.run([*CLI, "--cpu", "--num_processes", "2", *QUIET, *extra, WORKER],
                          env=worker_env(tmp_path, "allreduce", TMPDIR=str(scratch)), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert not list(scratch.glob("torchelastic_*")), sorted(p.name for p in scratch.iterdir())
    if user_log_dir:
        assert any((tmp_path / "logs").rglob("*.log"))  # the user's folder got torchrun's per-rank logs
