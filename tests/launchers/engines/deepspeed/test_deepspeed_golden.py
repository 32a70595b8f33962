"""The commands DeepSpeed's real runner builds from our launch plans, pinned by golden files (tests/golden/deepspeed/).

For each case the CLI's `--dry-run --json` gives our plan (runner arguments, environment, .deepspeed_env);
scripts/ds_runner_capture.py then runs DeepSpeed's real `runner.main` on exactly that, with fake cluster
programs first on PATH (tests/helpers/fakebin.py): the runner checks for its backend, asks `ssh` about the
first host, reads our .deepspeed_env through DS_ENV_FILE and starts mpirun/srun/pdsh, which record their
argv and exit. (test_deepspeed_runs.py runs the same path through the CLI, end to end, for pdsh.) A golden
file holds our runner command and the commands DeepSpeed ran, with machine-specific parts ({python},
{cwd}, {run_dir}, {port}, {deepspeed}) replaced. Regenerate with UPDATE_GOLDEN=1.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from helpers import fakebin  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[3] / "golden" / "deepspeed"
CAPTURE = Path(__file__).resolve().parents[2] / "scripts" / "ds_runner_capture.py"
HOSTS = {"two": "node1 slots=2\nnode2 slots=2\n", "three": "node1 slots=2\nnode2 slots=2\nnode3 slots=2\n"}
CASES = {
    "openmpi": (["--deepspeed_multinode_launcher", "openmpi"], "two", "mpirun"),
    "mpich": (["--deepspeed_multinode_launcher", "mpich"], "two", "mpirun"),
    "impi": (["--deepspeed_multinode_launcher", "impi"], "two", "mpirun"),
    "mvapich": (["--deepspeed_multinode_launcher", "mvapich"], "two", "mpirun"),
    "slurm": (["--deepspeed_multinode_launcher", "slurm"], "two", "srun"),
    "slurm-exclude": (["--deepspeed_multinode_launcher", "slurm", "--deepspeed_exclusion_filter", "node3"], "three", "srun"),
    "pdsh": (["--deepspeed_multinode_launcher", "pdsh", "--deepspeed_inclusion_filter", "node1:0,1@node2:1"], "three", "pdsh"),
}
MVAPICH_HOSTFILE = Path("/tmp/deepspeed_mvapich_hostfile")  # DeepSpeed's mvapich runner writes it

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """Plan every case, run DeepSpeed's runner on the plans, and return (exit code, golden text) per case."""
    deepspeed_dir = importlib.util.find_spec("deepspeed").submodule_search_locations[0]
    mvapich_existed = MVAPICH_HOSTFILE.exists()
    launches, cases = [], {}
    for name, (flags, hosts, _) in CASES.items():
        cwd = tmp_path_factory.mktemp(name)
        (cwd / "hostfile").write_text(HOSTS[hosts])
        (cwd / "train.py").write_text("print('train')\n")  # a missing script is refused at plan time
        port = _free_port()
        # a clean, fixed environment: DeepSpeed forwards every PYTHON*/MLFLOW*/UCX*/MV2* variable it sees
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "MLFLOW", "UCX", "MV2", "NCCL", "DS_"))}
        env.update(PATH=fakebin.path_with(fakebin.install(cwd / "bin")), FAKEBIN_LOG=str(cwd / "calls.log"),
                   FAKEBIN_RECORD_ONLY="1", HOME=str(cwd / "home"))
        argv = ["--num_processes", "4", "--num_machines", "2", "--machine_rank", "0", "--main_process_ip", "127.0.0.1",
                "--main_process_port", str(port), "--deepspeed_hostfile", "hostfile", "--zero_stage", "2",
                "--mixed_precision", "bf16", "--dynamo_backend", "no", *flags, "train.py", "--lr", "1", "--tag", "two words"]
        dry = subprocess.run(
            [sys.executable, "-m", "prefect_accelerate.cli.main", "launch", "--use_deepspeed", "--run_dir", str(cwd / "run"),
             "--dry-run", "--json", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=60,
        )
        assert dry.returncode == 0, dry.stderr
        plan = json.loads(dry.stdout)
        assert plan["argv"][1:3] == ["-m", "deepspeed.launcher.runner"]
        for path, content in plan["files"].items():  # what run_plan writes before it starts the runner
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(content)
        launches.append({"cwd": str(cwd), "env": {**env, **plan["env"]}, "args": plan["argv"][3:]})
        replace = [(str(cwd / "run"), "{run_dir}"), (str(cwd), "{cwd}"), (deepspeed_dir, "{deepspeed}"),
                   (sys.executable, "{python}"), (str(port), "{port}")]
        cases[name] = (cwd, plan["argv"], argv, replace)
    spec = tmp_path_factory.mktemp("capture") / "launches.json"
    spec.write_text(json.dumps(launches))
    try:
        done = subprocess.run([sys.executable, str(CAPTURE), str(spec)], capture_output=True, text=True, timeout=240)
    finally:
        if not mvapich_existed:
            MVAPICH_HOSTFILE.unlink(missing_ok=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    return {name: (code, done.stderr, _golden_text(name, argv, runner, fakebin.calls(cwd / "calls.log"), replace))
            for code, (name, (cwd, runner, argv, replace)) in zip(codes, cases.items(), strict=True)}


def _golden_text(name: str, argv: list[str], runner: list[str], calls: list[dict], replace) -> str:
    def normal(words: list[str]) -> str:
        text = shlex.join(words)
        for old, new in replace:
            text = text.replace(old, new)
        return text

    program = CASES[name][2]
    lines = [
        f"# prefect-accelerate launch --use_deepspeed {normal(argv)}",
        f"# hostfile: {' / '.join(HOSTS[CASES[name][1]].splitlines())}",
        f"runner (ours): {normal(runner)}",
    ]
    lines += [f"{call['program']} (DeepSpeed's): {normal([call['program'], *call['argv']])}" for call in calls]
    assert [call["program"] for call in calls][-1] == program, calls
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("name", list(CASES))
def test_runner_and_backend_commands_match_the_golden_file(captured, name):
    code, output, text = captured[name]
    assert code == 0, output[-3000:]
    golden = GOLDEN / f"{name}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text()
