"""The engine table: every row meets the protocol, routes and plans reach the right engine, nothing loads early."""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys

import pytest

from prefect_accelerate.cli.main import build_parser
from prefect_accelerate.launchers import choose_launcher, plan_launch
from prefect_accelerate.launchers.engines import ENGINES, JobHandle, engine_for_route, runner_for
from prefect_accelerate.launchers.flags import LAUNCH_FLAGS
from prefect_accelerate.launchers.host import StaticHost
from prefect_accelerate.launchers.options import options_from_namespace
from prefect_accelerate.launchers.plan import LaunchPlan
from prefect_accelerate.launchers.process import run_plan

GPU8 = StaticHost(kind="cuda", count=8, cores=16)
CPU = StaticHost(kind=None, count=0, cores=2)
MPS = StaticHost(kind="mps", count=1, cores=8)


def parse(*argv: str, host=GPU8):
    return options_from_namespace(build_parser().parse_args(["launch", *argv]), host=host, environ={})


def _keyword_only(function) -> set[str]:
    return {p.name for p in inspect.signature(function).parameters.values() if p.kind is p.KEYWORD_ONLY}


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_engine_row_names_functions_that_meet_the_protocol(name):
    engine = ENGINES[name]
    assert engine.name == name
    planner = engine.planner()
    assert list(inspect.signature(planner).parameters)[:2] == ["options", "host"]
    assert {"cwd", "run_dir"} <= _keyword_only(planner)
    if engine.remote:
        assert {"on_line", "timeout", "grace", "flow_run_id", "task_run_id"} <= _keyword_only(engine.runner())
        assert callable(engine.submitter())
        # the flow's cancellation hook stops a remote engine's recorded jobs through this column
        stopper = engine.stopper()
        assert callable(stopper) and list(inspect.signature(stopper).parameters)[:1] == ["flow_run_id"]
        assert engine.job_noun != "job"
    else:
        assert engine.runner() is run_plan and engine.submitter() is None and engine.stopper() is None


@pytest.mark.parametrize("handle", ["sagemaker.job:SageMakerJobRun", "slurm.job:SlurmJobRun", "kubernetes.job:KubernetesJobRun"])
def test_each_remote_job_handle_has_every_member_of_the_job_handle_protocol(handle):
    module, _, name = handle.partition(":")
    cls = getattr(importlib.import_module(f"prefect_accelerate.launchers.engines.{module}"), name)
    members = {n for n in vars(JobHandle) if not n.startswith("_")} | set(JobHandle.__annotations__)
    assert members == {"name", "status", "finished", "new_log_lines", "wait", "stop", "result"}
    missing = [m for m in members - {"name"} if not hasattr(cls, m)]
    assert not missing
    assert "self.name = " in inspect.getsource(cls.__init__)


def test_every_answer_of_choose_launcher_is_served_by_a_row():
    answers = {
        choose_launcher(parse("--use_deepspeed", "--num_processes", "2", "t.py")),
        choose_launcher(parse("--multi_gpu", "--num_processes", "2", "t.py")),
        choose_launcher(parse("--tpu", "t.py", host=CPU)),
        choose_launcher(parse("--cpu", "--num_processes", "2", "t.py")),
        choose_launcher(parse("--num_processes", "1", "t.py")),
    }
    assert answers == {"deepspeed", "torchrun", "tpu", "torchrun-cpu", "simple"}
    assert {a: engine_for_route(a).name for a in answers} == {
        "deepspeed": "deepspeed", "torchrun": "torchrun", "tpu": "tpu", "torchrun-cpu": "torchrun", "simple": "simple"}
    assert engine_for_route("sagemaker").remote


@pytest.mark.parametrize(("argv", "use_cpu", "host", "on_cpu"), [
    (("--multi_gpu", "--num_processes", "2"), False, GPU8, False),
    (("--multi_gpu", "--num_processes", "2"), False, CPU, True),   # no accelerator: gloo
    (("--multi_gpu", "--num_processes", "2"), False, MPS, True),   # torchrun cannot use MPS
    (("--use_fsdp", "--num_processes", "2"), True, GPU8, True),    # use_cpu from a config file
    (("--cpu", "--num_processes", "2"), False, GPU8, True),        # the torchrun-cpu route
])
def test_the_torchrun_engine_chooses_cpu_as_plan_launch_did_before(argv, use_cpu, host, on_cpu, tmp_path):
    options = parse(*argv, "t.py", host=host)
    if use_cpu:
        options = options.model_copy(update={"use_cpu": True})
    plan = plan_launch(options, host, cwd=str(tmp_path))
    assert plan.launcher == "torchrun"
    assert (plan.env.get("ACCELERATE_USE_CPU") == "True") is on_cpu


@pytest.mark.parametrize("label", ["simple", "mpirun", "torchrun", "torchrun-deepspeed", "deepspeed-pdsh", "tpu", "tpu-pod", "tpu-config"])
def test_local_plans_run_under_the_process_supervisor(label):
    assert runner_for(LaunchPlan(launcher=label, argv=("true",), cwd="/")) is run_plan


def test_sagemaker_plans_run_through_the_sagemaker_engine():
    from prefect_accelerate.launchers.engines.sagemaker.job import run_job

    assert runner_for(LaunchPlan(launcher="sagemaker", argv=(), cwd="/")) is run_job


def test_every_flag_that_belongs_to_an_engine_names_a_row():
    named = {flag.engine for flag in LAUNCH_FLAGS if flag.engine is not None}
    assert named and named <= set(ENGINES)


def test_planning_a_local_launch_loads_no_other_engine_and_neither_torch_nor_prefect(tmp_path):
    code = (
        "import json, sys\n"
        "from prefect_accelerate.launchers.options import build_launch_options\n"
        "from prefect_accelerate.launchers import plan_launch\n"
        "from prefect_accelerate.launchers.host import StaticHost\n"
        "host = StaticHost(kind=None, count=0, cores=2)\n"
        "plan_launch(build_launch_options('t.py', cpu=True, num_processes=2, host=host), host, cwd=sys.argv[1])\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('prefect', 'torch')))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout))
    engines = {m.split(".")[3] for m in loaded if m.startswith("prefect_accelerate.launchers.engines.")}
    assert engines == {"torchrun"}
    assert not {m for m in loaded if m == "torch" or m.startswith(("torch.", "prefect.")) or m == "prefect"}
