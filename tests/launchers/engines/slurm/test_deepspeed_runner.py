"""DeepSpeed's own `slurm` launcher under `launch --slurm`: the plan, and the srun DeepSpeed's real runner builds from it."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import fakebin
from prefect_accelerate.cli.main import build_parser
from prefect_accelerate.errors import UsageError
from prefect_accelerate.launchers.engines.slurm.job import SlurmJob, SlurmJobRun
from prefect_accelerate.launchers.engines.slurm.plan import plan as slurm_plan
from prefect_accelerate.launchers.host import StaticHost
from prefect_accelerate.launchers.options import options_from_namespace

DS = ["--use_deepspeed", "--zero_stage", "2", "--mixed_precision", "no", "--dynamo_backend", "no",
      "--deepspeed_multinode_launcher", "slurm", "--num_machines", "2"]


def _plan(extra: list[str], run_dir: str = "/shared/runs/r1", cwd: str = "/project", python: str = "/opt/venv/bin/python"):
    args = build_parser().parse_args(["launch", "--slurm", *DS, *extra, "train.py", "--lr", "3e-4"])
    return slurm_plan(options_from_namespace(args), StaticHost(python_path=python), cwd=cwd, run_dir=run_dir)


def _runner_line(plan) -> str:
    return next(line for line in plan.files[f"{plan.run_dir}/slurm.sbatch"].splitlines() if "deepspeed.launcher.runner" in line)


def test_the_batch_script_runs_deepspeeds_runner_once_on_a_hostfile_of_the_allocation():
    plan = _plan(["--num_processes", "4"])
    script = plan.files["/shared/runs/r1/slurm.sbatch"]
    assert "srun" not in script.replace("deepspeed.launcher.runner", "")  # DeepSpeed's runner runs srun, not the script
    assert "#SBATCH --ntasks-per-node=2" in script
    assert "sed 's/$/ slots=2/' > /shared/runs/r1/hostfile" in script
    runner = _runner_line(plan)
    for words in ("--hostfile /shared/runs/r1/hostfile", "--launcher slurm", "--no_ssh_check", "--num_nodes 2",
                  '--master_addr "${PA_HEAD_ADDR}" --master_port "${PA_PORT}"'):
        assert words in runner
    assert "export PYTHONPATH=/shared/runs/r1/site:" in script
    assert "/shared/runs/r1/site/sitecustomize.py" in plan.files and "/shared/runs/r1/node.sh" not in plan.files


def test_num_gpus_reaches_the_runner_only_when_the_job_asks_for_gpus():
    assert "--num_gpus" not in _runner_line(_plan(["--num_processes", "2"]))
    assert "--num_gpus 8" in _runner_line(_plan(["--num_processes", "16", "--slurm_gpus_per_node", "8"]))


def test_filters_and_uneven_process_counts_are_refused_with_what_to_do():
    with pytest.raises(UsageError, match="--slurm_sbatch_args"):
        _plan(["--num_processes", "2", "--deepspeed_exclusion_filter", "n3"])
    with pytest.raises(UsageError, match="multiple of --num_machines"):
        _plan(["--num_processes", "3"])


def test_output_of_deepspeeds_srun_is_labelled_by_node_and_rank_and_a_failing_task_names_both(tmp_path):
    plan = _plan(["--num_processes", "4"], run_dir=str(tmp_path))
    (tmp_path / "slurm.sbatch").write_text(plan.files[f"{tmp_path}/slurm.sbatch"])
    job = SlurmJobRun("7", run_dir=str(tmp_path), output=lambda label, line: None)
    assert job.label("3: rank 3 step 0") == ("node 1 rank 3", "rank 3 step 0")
    assert job.label("[prefect-accelerate] job 7") == ("slurm", "[prefect-accelerate] job 7")
    job.label("srun: error: n2: task 2: Exited with exit code 4")
    job.label("srun: error: n1: task 0: Terminated")
    job.last = SlurmJob(job_id="7", state="FAILED", exit_code=143)  # srun's highest task code: a terminated peer's
    result = job.result()
    assert (result.failed_node, result.failed_node_rank, result.failed_rank, result.exit_code) == ("n2", 1, 2, 4)


@pytest.mark.slow
def test_deepspeeds_real_runner_starts_one_srun_with_labels_and_no_gpus_on_a_cpu_launch(tmp_path):
    pytest.importorskip("deepspeed")
    run_dir = tmp_path / "run"
    plan = _plan(["--num_processes", "2"], run_dir=str(run_dir), cwd=str(tmp_path), python=sys.executable)
    for path, content in plan.files.items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(content)
    (run_dir / "hostfile").write_text("n1 slots=1\nn2 slots=1\n")  # what the batch script writes in the job
    log = tmp_path / "calls.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "MLFLOW", "UCX", "MV2", "DS_"))}
    env.update(PATH=fakebin.path_with(fakebin.install(tmp_path / "bin")), FAKEBIN_LOG=str(log), FAKEBIN_RECORD_ONLY="1",
               HOME=str(tmp_path / "home"), PA_HEAD_ADDR="127.0.0.1", PA_PORT="29999")
    exports = "".join(line + "\n" for line in plan.files[f"{run_dir}/slurm.sbatch"].splitlines() if line.startswith(("export ", "cd ", "exec ")))
    done = subprocess.run(["bash", "-c", exports], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    calls = [call for call in fakebin.calls(log) if call["program"] != "sinfo"]
    assert [call["program"] for call in calls] == ["srun"], calls  # no ssh check, one srun
    argv = calls[0]["argv"]
    assert argv[:6] == ["-n", "2", "--label", "--kill-on-bad-exit=1", "--ntasks-per-node=1", "--nodes"], argv
    assert "--gpus-per-node" not in argv
    export = next(arg for arg in argv if arg.startswith("--export=ALL"))
    assert f"{run_dir}/site" in export.split("PYTHONPATH=", 1)[1].split(",", 1)[0]
    assert argv[-4:] == ["-u", "train.py", "--lr", "3e-4"], shlex.join(argv)
