"""Launchers: from LaunchOptions to a LaunchPlan (pure), then to running processes or remote jobs.

`plan_launch` follows Accelerate's decision tree (reference §4.1): DeepSpeed, then FSDP / Megatron-LM /
multi-device through torchrun, then TPU, then SageMaker, else the simple launcher. One addition: a CPU
run with more than one process (`--cpu --num_processes 2`, or a MULTI_CPU config) goes through torchrun
with gloo, where Accelerate would start a single process (docs/compatibility.md).
"""

from __future__ import annotations

import importlib
import os

from prefect_accelerate.errors import LaunchError
from prefect_accelerate.launchers.host import HostProbe, local_host
from prefect_accelerate.launchers.plan import LaunchPlan

#: engine -> module that plans it; engines whose module is absent are "not available yet"
ENGINE_MODULES = {
    "deepspeed": "prefect_accelerate.launchers.deepspeed",
    "tpu": "prefect_accelerate.launchers.tpu",
    "sagemaker": "prefect_accelerate.launchers.sagemaker",
    "slurm": "prefect_accelerate.launchers.engines.slurm",
}


def choose_launcher(options, host: HostProbe | None = None) -> str:
    """Which launcher Accelerate's decision tree picks for these options (plus our CPU multi-process rule)."""
    if getattr(options, "slurm", False):
        return "slurm"  # ours: the whole launch becomes one Slurm job (the engine plans each node's launch)
    if options.use_deepspeed and not options.cpu:
        return "deepspeed"
    if (options.use_fsdp or options.use_megatron_lm or options.multi_gpu) and not options.cpu:
        return "torchrun"
    if options.tpu and not options.cpu:
        return "tpu"
    if options.compute_environment == "AMAZON_SAGEMAKER":
        return "sagemaker"
    if (options.cpu or options.use_cpu) and int(options.num_processes or 1) > 1 and options.mpirun_hostfile is None:
        return "torchrun-cpu"
    return "simple"


def _engine(name: str):
    try:
        return importlib.import_module(ENGINE_MODULES[name])
    except ModuleNotFoundError as error:
        if error.name != ENGINE_MODULES[name]:
            raise
        raise LaunchError(
            f"The {name} launcher is not available yet in this version of prefect-accelerate. Its flags are "
            f"accepted so that your command line parses, but nothing was started. Use a torchrun-based mode "
            f"(--multi_gpu, --use_fsdp, --cpu) meanwhile."
        ) from None


def plan_launch(options, host: HostProbe | None = None, *, cwd: str | None = None) -> LaunchPlan:
    """The plan for these options on `host` (this machine by default). Starts nothing.

    Raises:
        UsageError, ConfigError: the options contradict each other. LaunchError: the plan cannot be made
        (a busy port, a missing MPI, an engine this version does not have).
    """
    from prefect_accelerate.launchers.simple import plan_simple
    from prefect_accelerate.launchers.state import new_run_dir
    from prefect_accelerate.launchers.torchrun import plan_torchrun

    machine = host or local_host()
    where = cwd or os.getcwd()
    run_dir = options.run_dir or str(new_run_dir())
    kind = choose_launcher(options, machine)
    if kind == "torchrun":
        no_accelerator = machine.accelerator_kind() in (None, "mps")
        return plan_torchrun(options, machine, where, run_dir, cpu=bool(options.use_cpu) or no_accelerator)
    if kind == "torchrun-cpu":
        return plan_torchrun(options, machine, where, run_dir, cpu=True)
    if kind == "simple":
        return plan_simple(options, machine, where, run_dir)
    return _engine(kind).plan(options, machine, cwd=where, run_dir=run_dir)


__all__ = ["LaunchPlan", "choose_launcher", "plan_launch"]
