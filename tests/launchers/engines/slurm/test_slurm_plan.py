"""The Slurm plan (pure): golden sbatch scripts and node commands; dry-run imports neither torch nor Prefect."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefect_accelerate.cli.main import build_parser
from prefect_accelerate.errors import UsageError
from prefect_accelerate.launchers.engines.slurm.plan import plan as slurm_plan
from prefect_accelerate.launchers.engines.slurm.job import SlurmJobRun
from prefect_accelerate.launchers.host import StaticHost
from prefect_accelerate.launchers.options import options_from_namespace

GOLDEN = Path(__file__).resolve().parents[3] / "golden" / "slurm"
CASES = {
    "two-nodes-cpu": ["--num_machines", "2", "--num_processes", "2", "--slurm_partition", "debug", "--slurm_time", "00:10:00"],
    "four-nodes-gpus": ["--multi_gpu", "--mixed_precision", "bf16", "--dynamo_backend", "no", "--num_machines", "4", "--num_processes", "32",
                        "--slurm_gpus_per_node", "8", "--slurm_account", "ml", "--slurm_qos", "high",
                        "--slurm_sbatch_args", "--exclusive --mem=0"],
    "deepspeed-slurm-cpu": ["--use_deepspeed", "--zero_stage", "2", "--mixed_precision", "no", "--dynamo_backend", "no",
                            "--deepspeed_multinode_launcher", "slurm", "--num_machines", "2", "--num_processes", "4",
                            "--slurm_partition", "debug"],
}


def _plan(extra: list[str]):
    args = build_parser().parse_args(["launch", "--slurm", *extra, "train.py", "--lr", "3e-4"])
    return slurm_plan(options_from_namespace(args), StaticHost(python_path="/opt/venv/bin/python"), cwd="/project", run_dir="/shared/runs/r1")


@pytest.mark.parametrize("name", sorted(CASES))
def test_dry_run_matches_golden_file(name, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)  # DeepSpeed plans carry the launching PYTHONPATH
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")  # set: no plan adds its own PYTHONUNBUFFERED=1
    text = _plan(CASES[name]).describe() + "\n"
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("PREFECT_ACCELERATE_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text()


def test_every_node_gets_its_rank_and_the_job_chosen_head_and_port():
    plan = _plan(CASES["four-nodes-gpus"])
    nodes = plan.request["nodes"]
    assert [n["node_rank"] for n in nodes] == [0, 1, 2, 3]
    for node in nodes:
        assert f"--node_rank {node['node_rank']} " in node["command"]
        assert '"${PA_HEAD_ADDR}:${PA_PORT}"' in node["command"] and "--nproc_per_node 8" in node["command"]
    script = plan.files["/shared/runs/r1/slurm.sbatch"]
    assert "#SBATCH --gpus-per-node=8" in script and "#SBATCH --exclusive" in script


def test_secret_variables_are_never_written_into_the_scripts(monkeypatch):
    base = _plan(CASES["two-nodes-cpu"])
    secret_plan = base.model_copy(update={"env": {"HF_TOKEN": "hf_abcdefghijklmnop"}})
    assert "hf_abcdefghijklmnop" not in secret_plan.describe() and "hf_abcdefghijklmnop" not in secret_plan.to_json()
    assert all("HF_TOKEN" not in content for content in base.files.values())


def test_sbatch_options_we_set_ourselves_are_refused():
    with pytest.raises(UsageError, match="--slurm_sbatch_args sets --nodes"):
        _plan(["--slurm_sbatch_args=--nodes=3"])


def test_planning_twice_gives_the_same_plan():
    assert _plan(CASES["two-nodes-cpu"]) == _plan(CASES["two-nodes-cpu"])


def test_dry_run_imports_neither_torch_nor_prefect(tmp_path):
    code = ("import sys; from prefect_accelerate.cli.main import main; "
            "rc = main(['launch', '--slurm', '--num_machines', '2', '--num_processes', '2', '--dry-run', 'train.py']); "
            "assert 'torch' not in sys.modules and 'prefect' not in sys.modules, 'heavy import'; sys.exit(rc)")
    (tmp_path / "train.py").write_text("print('train')\n")  # a missing script is refused at plan time
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "srun --nodes=2" in done.stdout


def test_no_sbatch_on_path_is_one_paragraph_and_exit_2(tmp_path):
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}
    (tmp_path / "train.py").write_text("print('train')\n")
    done = subprocess.run([sys.executable, "-m", "prefect_accelerate.cli.main", "launch", "--no-track", "--slurm", "--num_machines", "2",
                           "--num_processes", "2", "--run_dir", str(tmp_path / "run"), "train.py"],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "`sbatch` was not found on PATH" in done.stderr and "Traceback" not in done.stderr


def test_the_slurm_deployment_plans_one_batch_job_over_two_nodes():
    import yaml

    from prefect_accelerate.flows.pipeline import launch_options
    from prefect_accelerate.pipeline.models import PipelineRequest

    spec = yaml.safe_load((Path(__file__).resolve().parents[4] / "deployments" / "prefect.yaml").read_text())
    request = PipelineRequest.model_validate(next(d for d in spec["deployments"] if d["name"] == "slurm")["parameters"]["request"])
    plan = slurm_plan(launch_options(request), StaticHost(), cwd="/project", run_dir="/shared/runs/r2")
    assert plan.launcher == "slurm" and plan.num_machines == 2
    assert "#SBATCH --time=00:30:00" in plan.files["/shared/runs/r2/slurm.sbatch"]


def test_cluster_block_values_fill_in_what_flags_leave_out(monkeypatch):
    from prefect_accelerate.launchers.engines.slurm import block

    saved = {"partition": "gpu", "account": "ml", "setup_lines": ["module load cuda/12.4"], "sbatch_args": ["--exclusive"]}
    monkeypatch.setattr(block, "load_cluster_block", lambda name: saved if name == "hpc" else {})
    plan = _plan(["--num_machines", "2", "--num_processes", "2", "--slurm_block", "hpc", "--slurm_account", "other"])
    script = plan.files["/shared/runs/r1/slurm.sbatch"]
    assert "#SBATCH --partition=gpu" in script and "#SBATCH --account=other" in script and "#SBATCH --exclusive" in script
    assert script.index("module load cuda/12.4") < script.index("srun ")


_PLAN = _plan(CASES["two-nodes-cpu"])
_SHOWN = _PLAN.describe() + _PLAN.to_json() + "".join(_PLAN.files.values())
_SECRET = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126, blacklist_characters="*"), min_size=6, max_size=40)


@settings(max_examples=60, deadline=None)
@given(value=_SECRET, name=st.sampled_from(["HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "HUGGING_FACE_HUB_TOKEN"]))
def test_a_secret_variable_never_reaches_dry_run_output_scripts_or_the_handles_lines(value, name):
    plan = _PLAN.model_copy(update={"env": {name: value}})
    shown = plan.describe() + plan.to_json() + "".join(plan.files.values())
    # never more often than the plan without the secret has that text anyway (fewer: the redactor also blanks it there)
    assert shown.count(value) <= _SHOWN.count(value)
    lines: list[str] = []
    job = SlurmJobRun("1", output=lambda label, line: lines.append(line), secrets=list(plan.env.values()))
    job.emit("node 0 rank 0", f"token is {value}!")
    assert value not in lines[0] and "***" in lines[0]


def test_a_deepspeed_config_runs_deepspeeds_standard_launch_on_every_node():
    plan = _plan(["--use_deepspeed", "--zero_stage", "2", "--deepspeed_multinode_launcher", "standard",
                  "--num_machines", "2", "--num_processes", "2"])
    node = plan.files["/shared/runs/r1/node.sh"]
    assert plan.request["node_launcher"] == "torchrun-deepspeed"
    assert "export ACCELERATE_USE_DEEPSPEED=true" in node and "export ACCELERATE_DEEPSPEED_ZERO_STAGE=2" in node
    assert '--node_rank "${SLURM_NODEID}"' in node


@pytest.mark.parametrize("launcher", ["pdsh", "openmpi"])
def test_deepspeed_launchers_that_start_processes_over_ssh_or_mpi_are_refused(launcher, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("n1 slots=1\nn2 slots=1\n")
    with pytest.raises(UsageError, match="use `standard`"):
        _plan(["--use_deepspeed", "--zero_stage", "2", "--deepspeed_multinode_launcher", launcher, "--deepspeed_hostfile",
               str(hostfile), "--num_machines", "2", "--num_processes", "2"])


def test_the_handle_reads_new_output_lines_labelled_and_redacted_without_a_cluster(tmp_path):
    from prefect_accelerate.launchers.engines.slurm.job import SlurmJobRun

    out = tmp_path / "slurm-7.out"
    out.write_text("[prefect-accelerate] job 7 on n[1-2]\n1: [default0]:loss 0.5 token s3cret-value\n0: half a li")
    job = SlurmJobRun("7", output_path=str(out), secrets=["s3cret-value"], run_dir=str(tmp_path))
    assert (job.name, job.status) == ("7", "UNKNOWN")
    assert job.new_log_lines() == [("slurm", "[prefect-accelerate] job 7 on n[1-2]"), ("node 1 rank 1", "loss 0.5 token ***")]
    with out.open("a") as handle:
        handle.write("ne\n")
    assert job.new_log_lines() == [("node 0", "half a line")]  # a node's own line (no rank prefix)
    assert job.new_log_lines() == []


def test_a_rank_killed_by_a_signal_is_named_and_a_peers_stop_message_is_not_taken_for_its_cause(tmp_path):
    """Seen on CI: rank 0 aborted (SIGABRT), srun then stopped node 1, whose torchrun wrote "got signal: 15"."""
    from prefect_accelerate.launchers.engines.slurm.job import SlurmJob

    out = tmp_path / "slurm-7.out"
    table = ["Root Cause (first observed failure):", "[0]:", "  rank      : 0 (local_rank: 0)",
             "  exitcode  : -6 (pid: 4202)  (SIGABRT)", "  traceback : Signal 6 (SIGABRT) received by PID 4202"]
    out.write_text("\n".join([*(f"0: {line}" for line in table), "srun: error: n1: task 0: Exited with exit code 1",
                              "1: SignalException: Process 4188 got signal: 15",
                              "srun: error: n2: task 1: Exited with exit code 1", ""]))
    (tmp_path / "error-node-1.json").write_text(
        '{"message": {"message": "SignalException: Process 4188 got signal: 15", "errorCode": null}}')
    job = SlurmJobRun("7", output_path=str(out), run_dir=str(tmp_path), output=lambda label, line: None)
    for label, line in job.new_log_lines():
        job.emit(label, line)  # as the job's follower does
    job.last = SlurmJob(job_id="7", state="FAILED", exit_code=1)
    result = job.result()
    assert (result.failed_node, result.failed_node_rank, result.failed_rank) == ("n1", 0, 0)
    assert result.error == "the process was killed by SIGABRT"
    (tmp_path / "error-node-0.json").write_text('{"message": {"message": "RuntimeError: rank 0 broke", "errorCode": null}}')
    del job._layout_found
    assert job.result().error == "RuntimeError: rank 0 broke"  # the failing node's own file, when it wrote one
