"""The Slurm engine on a real two-node Slurm (conftest.py): training, failures, cancel, SIGTERM, time limit, attach."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefect_accelerate.launchers.engines.slurm.job import SlurmJobRun

pytestmark = pytest.mark.slow

WORKLOAD = Path(__file__).with_name("workload.py")
DS_WORKLOAD = Path(__file__).with_name("ds_workload.py")
CLI = [sys.executable, "-m", "prefect_accelerate.cli.main"]
#: generous: a 2-node torch job takes 5-30 s on a loaded 2-core machine
JOB_SECONDS = 300


def _launch_args(run_dir: Path, *extra: str) -> list[str]:
    return [*CLI, "launch", "--no-track", "--slurm", "--num_machines", "2", "--num_processes", "2",
            "--run_dir", str(run_dir), *extra, str(WORKLOAD)]


def _plan(run_dir: Path, *extra: str):
    from prefect_accelerate.cli.main import build_parser
    from prefect_accelerate.cli.launch_cmd import plan_from_args

    args = build_parser().parse_args(["launch", "--slurm", "--num_machines", "2", "--num_processes", "2",
                                      "--run_dir", str(run_dir), *extra, str(WORKLOAD)])
    return plan_from_args(args)[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _hang_pids(folder: Path, count: int = 2, timeout: float = JOB_SECONDS) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        files = sorted(folder.glob("pids-*"))
        if len(files) == count and all(f.read_text().endswith("\n") for f in files):
            return [int(p) for f in files for p in f.read_text().split()]
        time.sleep(0.2)
    raise AssertionError(f"the ranks did not start within {timeout} s")


def _wait_gone(pids: list[int], timeout: float = 60.0) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def _queue() -> str:
    return subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True).stdout.strip()


def _queued_ids() -> set[str]:
    """The job IDs in the queue; states are left out, since the module's time-limit job changes state under us."""
    return {line.split()[0] for line in _queue().splitlines() if line.strip()}


@pytest.fixture(scope="module")
def timeout_job(slurm_cluster, tmp_path_factory):
    """A one-node job with a 1-minute limit, submitted first so its ~65 s overlap the other tests."""
    folder = tmp_path_factory.mktemp("timeout")
    script = folder / "limit.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --partition=small\n#SBATCH --time=1\n#SBATCH --output={folder}/out-%j\n"
                      "#SBATCH --no-requeue\necho started\nsleep 600\n")
    job_id = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True).stdout.strip()
    return SlurmJobRun(job_id, output_path=str(folder / f"out-{job_id}"), output=lambda label, line: None, poll_seconds=1.0)


def _cluster_logs(cluster) -> str:
    """What Slurm said, for a failure's message: the controller's and both nodes' last lines."""
    return "\n".join(f"--- {name}:\n{cluster.log(name)[-1500:]}" for name in ("slurmctld", "slurmd-n1", "slurmd-n2"))


def test_two_node_training_ranks_agree_on_world_size_and_weights(slurm_cluster, timeout_job, tmp_path):
    done = subprocess.run(_launch_args(tmp_path / "run"), capture_output=True, text=True, timeout=JOB_SECONDS)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + _cluster_logs(slurm_cluster)
    lines = re.findall(r"rank=(\d) world=(\d) weights=(\S+) node=(\S+)", done.stdout)
    assert re.search(r"^\[node 1 rank 1\] rank=1 world=2", done.stdout, re.M), "console lines are not labelled by node and rank"
    assert sorted(rank for rank, *_ in lines) == ["0", "1"], done.stdout
    assert {world for _, world, _, _ in lines} == {"2"}
    assert len({weights for _, _, weights, _ in lines}) == 1, "DDP ranks ended with different weights"
    assert sorted(node for *_, node in lines) == ["n1", "n2"], "the two ranks did not run on the two Slurm nodes"
    assert "COMPLETED" in done.stdout


DS_SLURM_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_multinode_launcher: slurm
  gradient_accumulation_steps: 1
  zero_stage: 2
machine_rank: 0
mixed_precision: 'no'
num_machines: 2
num_processes: 2
use_cpu: false
"""


def test_deepspeeds_own_slurm_launcher_trains_on_both_nodes_with_one_world(slurm_cluster, tmp_path):
    pytest.importorskip("deepspeed")
    config = tmp_path / "ds_slurm.yaml"
    config.write_text(DS_SLURM_CONFIG)
    argv = [*CLI, "launch", "--no-track", "--slurm", "--config_file", str(config), "--dynamo_backend", "no",
            "--run_dir", str(tmp_path / "run"), str(DS_WORKLOAD), "--steps", "2"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=JOB_SECONDS, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:] + _cluster_logs(slurm_cluster)
    nodes = dict(re.findall(r"^\[node \d rank (\d)\] node=(\S+) rank_env=\1/2 local=0", done.stdout, re.M))
    assert nodes == {"0": "n1", "1": "n2"}, done.stdout[-4000:]
    results = re.findall(r"^\[node (\d) rank (\d)\] rank \2 of (\d) zero_stage 2 dtype float32 eval_loss (\S+)", done.stdout, re.M)
    assert sorted((node, rank, world) for node, rank, world, _ in results) == [("0", "0", "2"), ("1", "1", "2")], done.stdout[-4000:]
    assert len({loss for *_, loss in results}) == 1, "the two ranks ended with different weights"
    srun = re.search(r"cmd = (srun .*)", done.stdout)
    assert srun and srun.group(1).startswith("srun -n 2 --label") and "--gpus-per-node" not in srun.group(1), done.stdout[-4000:]
    assert "COMPLETED" in done.stdout


def test_deepspeeds_slurm_launcher_reports_the_failing_ranks_exit_code_node_and_rank(slurm_cluster, tmp_path):
    pytest.importorskip("deepspeed")
    config = tmp_path / "ds_slurm.yaml"
    config.write_text(DS_SLURM_CONFIG)
    env = {**os.environ, "FAIL_RANK": "1", "FAIL_RANK_CODE": "3"}
    argv = [*CLI, "launch", "--no-track", "--slurm", "--config_file", str(config), "--dynamo_backend", "no",
            "--run_dir", str(tmp_path / "run"), str(DS_WORKLOAD)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=JOB_SECONDS, cwd=tmp_path, env=env)
    assert done.returncode == 3, done.stdout[-4000:] + done.stderr[-3000:] + _cluster_logs(slurm_cluster)
    assert "node 1 (n2)" in done.stderr and "rank 1" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_failing_rank_exit_code_is_the_cli_exit_code_with_node_and_rank(slurm_cluster, tmp_path):
    env = {**os.environ, "FAIL_RANK": "1", "FAIL_RANK_CODE": "4"}
    done = subprocess.run(_launch_args(tmp_path / "run"), capture_output=True, text=True, timeout=JOB_SECONDS, env=env)
    assert done.returncode == 4, done.stdout[-3000:] + done.stderr[-3000:] + _cluster_logs(slurm_cluster)
    assert "Traceback" not in done.stderr
    assert "rank 1" in done.stderr and "node 1" in done.stderr, done.stderr


def test_a_rank_that_raises_is_reported_with_its_error(slurm_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("FAIL_RANK", "0")
    lines: list[tuple[str, str]] = []
    job = SlurmJobRun.submit(_plan(tmp_path / "run"), output=lambda label, line: lines.append((label, line)))
    job.wait(timeout=JOB_SECONDS)
    result = job.result()
    assert result.state == "FAILED"
    assert result.failed_rank == 0 and result.failed_node_rank == 0
    assert "broke on purpose" in (result.error or "")
    assert any(label == "node 1 rank 1" and "world=2" in line for label, line in lines), lines


@pytest.mark.parametrize(("how", "code"), [("sigterm", 143), ("ctrl-c", 130)])
def test_sigterm_or_ctrl_c_on_the_cli_cancels_the_job(slurm_cluster, tmp_path, how, code):
    env = {**os.environ, "HANG_DIR": str(tmp_path)}
    # its own process group, as a terminal's foreground job, with SIGINT as a shell hands it down
    cli = subprocess.Popen(_launch_args(tmp_path / "run"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                           start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        pids = _hang_pids(tmp_path)
        if how == "sigterm":
            cli.send_signal(signal.SIGTERM)
        else:
            os.killpg(cli.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        out, _ = cli.communicate(timeout=120)
    finally:
        if cli.poll() is None:
            cli.kill()
    job_id = re.search(r"Submitted batch job (\d+)", out).group(1)
    assert cli.returncode == code, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert _wait_gone(pids) == [], out
    state = SlurmJobRun(job_id).describe().state
    assert state == "CANCELLED", out
    from prefect_accelerate.launchers.engines.slurm.job import SLURM_JOBS
    from prefect_accelerate.launchers.state import read_records

    assert [r for r in read_records(SLURM_JOBS, this_host=False) if r["job_id"] == job_id] == [], "a stale job record was left"


def test_stop_cancels_the_job_everywhere_and_an_attached_second_process_sees_it(slurm_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("HANG_DIR", str(tmp_path))
    job = SlurmJobRun.submit(_plan(tmp_path / "run"), output=lambda label, line: None)
    with job:
        watcher = subprocess.Popen(
            [sys.executable, "-c", "import sys; from prefect_accelerate.launchers.engines.slurm.job import SlurmJobRun; "
             "job = SlurmJobRun.attach(sys.argv[1], output=lambda l, s: print(f'[{l}] {s}', flush=True)); "
             "job.wait(); print('final', job.result().state, flush=True)", job.job_id],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        pids = _hang_pids(tmp_path)
        time.sleep(2)  # the watcher is following a RUNNING job when it is cancelled
        final = job.stop()
        out, _ = watcher.communicate(timeout=120)
    assert final.state == "CANCELLED"
    assert _wait_gone(pids) == [], "processes outlived scancel (the double-forked sleep included)"
    assert job.job_id not in _queue().split()
    assert "[node 0 rank 0] rank=0 world=2" in out, out
    assert "final CANCELLED" in out, out


@pytest.mark.parametrize(("extra", "expected"), [
    (["--slurm_partition", "nope"], "invalid partition"),
    (["--slurm_partition", "small"], "can never start it"),  # 2 nodes asked, the partition has 1
    (["--slurm_sbatch_args=--begin=now+3600", "--slurm_pending_timeout", "3"], "still pending after 3 s"),
])
def test_bad_requests_exit_2_with_slurms_reason_and_leave_nothing_queued(slurm_cluster, tmp_path, extra, expected):
    before = _queued_ids()
    done = subprocess.run(_launch_args(tmp_path / "run", *extra), capture_output=True, text=True, timeout=JOB_SECONDS)
    assert done.returncode == 2, done.stdout + done.stderr
    assert expected in done.stderr.lower() or expected in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert _queued_ids() - before == set(), _queue()


def test_the_prefect_launch_task_follows_the_job_and_the_flows_cancel_hook_scancels_it(slurm_cluster, prefect_harness, tmp_path, monkeypatch):
    import threading

    from prefect import flow

    from prefect_accelerate.errors import LaunchError
    from prefect_accelerate.flows.launch import end_launch_processes
    from prefect_accelerate.launchers.engines.slurm.job import SLURM_JOBS
    from prefect_accelerate.launchers.state import read_records
    from prefect_accelerate.tasks.launch import launch

    monkeypatch.setenv("HANG_DIR", str(tmp_path))
    plan = _plan(tmp_path / "run")
    seen: dict = {}

    def cancel_like_prefect_would() -> None:
        seen["pids"] = _hang_pids(tmp_path)
        records = [r for r in read_records(SLURM_JOBS, this_host=False) if r.get("flow_run_id")]
        seen["record"] = records[0] if records else {}
        run = type("FlowRun", (), {"id": seen["record"].get("flow_run_id")})()
        end_launch_processes(None, run, None)  # what on_cancellation runs
        if not records:  # never leave the flow hanging on a job nobody cancels
            subprocess.run(["scancel", "--name", plan.request["job_name"]])

    @flow
    def train():
        return launch(plan=plan)

    canceller = threading.Thread(target=cancel_like_prefect_would)
    canceller.start()
    with pytest.raises(LaunchError, match="CANCELLED"):
        train()
    canceller.join(timeout=60)
    assert seen["record"].get("flow_run_id"), "the job was not recorded with its flow run"
    assert _wait_gone(seen["pids"]) == []
    assert SlurmJobRun(seen["record"]["job_id"]).describe().state == "CANCELLED"


def test_the_launch_deadline_cancels_the_job_and_exits_124(slurm_cluster, tmp_path):
    env = {**os.environ, "HANG_DIR": str(tmp_path)}
    done = subprocess.run(_launch_args(tmp_path / "run", "--timeout", "5"), capture_output=True, text=True, timeout=JOB_SECONDS, env=env)
    assert done.returncode == 124, done.stdout + done.stderr
    job_id = re.search(r"Submitted batch job (\d+)", done.stdout).group(1)
    assert SlurmJobRun(job_id).describe().state == "CANCELLED"
    assert "deadline" in done.stderr and "Traceback" not in done.stderr
    pids = [int(p) for f in tmp_path.glob("pids-*") for p in f.read_text().split()]
    assert _wait_gone(pids) == []


# last in the module: the 1-minute job submitted by the first test has been running all along
def test_time_limit_is_reported_as_timeout(timeout_job):
    job = timeout_job.wait(timeout=JOB_SECONDS)
    assert job.state == "TIMEOUT"
    assert "started" in "\n".join(timeout_job.tail)
