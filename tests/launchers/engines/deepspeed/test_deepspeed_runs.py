"""Real DeepSpeed launches on this machine's CPUs (DeepSpeed's CPU accelerator, gloo).

Training runs go through `prefect-accelerate launch --no-track --use_deepspeed` with examples/ds_train.py,
wrapped by scripts/ds_nojit.py so DeepSpeed does not compile its shared-memory op (~95 s on 2 cores, and
~66 MB per rank left in /dev/shm). Multi-node runs use scripts/ds_probe.py (gloo all-reduce, no DeepSpeed
import in the ranks) to keep the suite short; DeepSpeed's own runner and launcher still run for real.
Each test removes any /dev/shm/deepspeed_allreduce_buffer_* named after the port it used.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytest.importorskip("deepspeed")

from helpers import fakebin  # noqa: E402
from helpers.processes import assert_all_gone  # noqa: E402

REPO = Path(__file__).resolve().parents[4]
SCRIPTS = REPO / "tests" / "launchers" / "scripts"
NOJIT = str(SCRIPTS / "ds_nojit.py")
TRAIN = str(REPO / "examples" / "ds_train.py")
PROBE = str(SCRIPTS / "ds_probe.py")
CLI = [sys.executable, "-m", "prefect_accelerate.cli.main", "launch", "--no-track", "--use_deepspeed"]
QUIET = ["--mixed_precision", "no", "--dynamo_backend", "no"]
EVAL = re.compile(r"rank (\d) of (\d) zero_stage (\d) dtype (\w+) eval_loss (\S+)")

pytestmark = pytest.mark.slow


@pytest.fixture
def port():
    """A free port for the launch; DeepSpeed shm buffers named after it are removed afterwards."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        number = sock.getsockname()[1]
    yield number
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{number}_*"):
        os.remove(path)


def run(argv, tmp_path, timeout=240, **env):
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env={**os.environ, **env})


@pytest.mark.parametrize("stage, precision, files", [
    (2, "no", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]),
    (3, "bf16", ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt",
                 "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]),
])
def test_two_rank_zero_training_step_agrees_on_both_ranks_and_saves(tmp_path, port, stage, precision, files):
    done = run([*CLI, "--num_processes", "2", "--zero_stage", str(stage), "--mixed_precision", precision, "--dynamo_backend", "no",
                "--main_process_port", str(port), NOJIT, TRAIN, "--save_dir", str(tmp_path / "ckpt")], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = {int(m[0]): m for m in EVAL.findall(done.stdout)}
    assert sorted(results) == [0, 1], done.stdout[-2000:]
    for rank, world, zero, dtype, _ in results.values():
        assert (world, zero, dtype) == ("2", str(stage), "bfloat16" if precision == "bf16" else "float32")
    assert results[0][4] == results[1][4]  # trained on different batches, same weights afterwards
    assert "[rank 0] rank 0 step 2 train_loss" in done.stdout and "[rank 1] rank 1 step 2 train_loss" in done.stdout
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step3"
    for name in files:
        assert (tmp_path / "ckpt" / "step3" / name).is_file(), sorted(os.listdir(tmp_path / "ckpt" / "step3"))


def test_two_nossh_nodes_on_loopback_reach_world_size_two(tmp_path, port):
    (tmp_path / "hostfile").write_text("nodeA slots=1\nnodeB slots=1\n")
    common = [*CLI, *QUIET, "--num_processes", "2", "--num_machines", "2", "--deepspeed_multinode_launcher", "nossh",
              "--deepspeed_hostfile", "hostfile", "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
              "--zero_stage", "3"]
    nodes = [subprocess.Popen([*common, "--machine_rank", str(rank), PROBE], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=240) for node in nodes]
    for node, (out, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, out[-2000:] + err[-2000:]
    assert "rank 0 of 2 sum 3.0 stage 3" in outputs[0][0]
    assert "rank 1 of 2 sum 3.0 stage 3" in outputs[1][0]
    assert "node_rank=0" in outputs[0][0] and "node_rank=1" in outputs[1][0]
    assert not (tmp_path / ".deepspeed_env").exists()


def test_pdsh_runner_end_to_end_forwards_the_launch_variables(tmp_path, port):
    """DeepSpeed's real runner builds the pdsh command; the fake pdsh runs it per host with a bare environment."""
    (tmp_path / "hostfile").write_text("nodeA slots=1\nnodeB slots=1\n")
    (tmp_path / ".deepspeed_env").write_text("FROM_USER_FILE=1\n")
    before = (tmp_path / ".deepspeed_env").read_text()
    log = tmp_path / "fakebin.log"
    bin_dir = fakebin.install(tmp_path / "bin", ("pdsh", "ssh"))
    done = run([*CLI, *QUIET, "--num_processes", "2", "--num_machines", "2", "--deepspeed_hostfile", "hostfile",
                "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--zero_stage", "1",
                "--run_dir", str(tmp_path / "run"), PROBE], tmp_path, PATH=fakebin.path_with(bin_dir), FAKEBIN_LOG=str(log))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # stage 1 arrives only through the exports DeepSpeed built from .deepspeed_env: the fake pdsh passes no environment
    assert "nodeA: rank 0 of 2 sum 3.0 stage 1" in done.stdout
    assert "nodeB: rank 1 of 2 sum 3.0 stage 1" in done.stdout
    calls = fakebin.calls(log)
    assert [c["program"] for c in calls] == ["ssh", "pdsh"]
    assert calls[0]["argv"] == ["-o", "PasswordAuthentication=no", "nodeA", "hostname"]
    pdsh = calls[1]["argv"]
    assert pdsh[:5] == ["-S", "-f", "1024", "-w", "nodeA,nodeB"]
    assert "export ACCELERATE_DEEPSPEED_ZERO_STAGE=1;" in pdsh[5] and "export FROM_USER_FILE=1;" in pdsh[5]
    assert "--node_rank=%n" in pdsh and "--no_local_rank" in pdsh and f"--master_port={port}" in pdsh
    env_file = (tmp_path / "run" / ".deepspeed_env").read_text()
    assert "ACCELERATE_USE_DEEPSPEED=true\n" in env_file and "FROM_USER_FILE=1\n" in env_file
    assert (tmp_path / ".deepspeed_env").read_text() == before


@pytest.mark.parametrize("kind", ["torchrun", "nossh"])
def test_sigterm_to_a_deepspeed_launch_leaves_no_process_behind(tmp_path, port, kind):
    """torchrun path (launcher, 2 workers), and DeepSpeed's runner path (runner, its launcher, a worker waiting for node 1)."""
    pids = tmp_path / "pids"
    pids.mkdir()
    argv = [*CLI, *QUIET, "--num_processes", "2", "--main_process_port", str(port)]
    expected = 2
    if kind == "nossh":
        (tmp_path / "hostfile").write_text("nodeA slots=1\nnodeB slots=1\n")
        argv += ["--num_machines", "2", "--machine_rank", "0", "--deepspeed_multinode_launcher", "nossh",
                 "--deepspeed_hostfile", "hostfile", "--main_process_ip", "127.0.0.1"]
        expected = 1  # node 1 is never started, so rank 0 waits in the rendezvous
    env = {**os.environ, "PROBE_PID_DIR": str(pids), "PROBE_SLEEP": "600"}
    cli = subprocess.Popen([*argv, PROBE], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while len(list(pids.glob("*.pid"))) < expected and time.monotonic() < deadline and cli.poll() is None:
        time.sleep(0.2)
    workers = [int(p.read_text()) for p in pids.glob("*.pid")]
    assert len(workers) == expected, cli.communicate(timeout=30)
    tree = [p.pid for p in psutil.Process(cli.pid).children(recursive=True)]
    assert len(tree) >= expected + 1  # the launcher(s) above the workers
    cli.send_signal(signal.SIGTERM)
    _, err = cli.communicate(timeout=90)
    assert cli.returncode == 143, err[-2000:]
    assert_all_gone(workers + tree)
