"""Launchers: from LaunchOptions to a LaunchPlan (pure), then to running processes or remote jobs.

This package holds what every engine shares (options, flags, the environment blocks, the plan, the host,
the result) and the supervision of local processes (process, execute, state); each engine lives in
engines/<name> and is named in the table there (ENGINES). See docs/architecture.md.

`plan_launch` follows Accelerate's decision tree (reference §4.1): DeepSpeed, then FSDP / Megatron-LM /
multi-device through torchrun, then TPU, then SageMaker, else the simple launcher. One addition: a CPU
run with more than one process (`--cpu --num_processes 2`, or a MULTI_CPU config) goes through torchrun
with gloo, where Accelerate would start a single process (docs/compatibility.md).
"""

from __future__ import annotations

import os

from prefect_accelerate.launchers.engines import ENGINES, engine_for_route
from prefect_accelerate.launchers.host import HostProbe, local_host
from prefect_accelerate.launchers.plan import LaunchPlan


def choose_launcher(options, host: HostProbe | None = None) -> str:
    """Which launcher Accelerate's decision tree picks for these options (plus our CPU multi-process rule)."""
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


def plan_launch(options, host: HostProbe | None = None, *, cwd: str | None = None) -> LaunchPlan:
    """The plan for these options on `host` (this machine by default). Starts nothing.

    Raises:
        UsageError, ConfigError: the options contradict each other. LaunchError: the plan cannot be made
        (a busy port, a missing MPI, a missing engine dependency).
    """
    from prefect_accelerate.launchers.state import new_run_dir

    machine = host or local_host()
    where = cwd or os.getcwd()
    run_dir = options.run_dir or str(new_run_dir())
    engine = engine_for_route(choose_launcher(options, machine))
    return engine.planner()(options, machine, cwd=where, run_dir=run_dir)


__all__ = ["ENGINES", "LaunchPlan", "choose_launcher", "plan_launch"]
