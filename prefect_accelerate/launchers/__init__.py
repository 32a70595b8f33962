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

from prefect_accelerate.errors import USAGE_EXIT_CODE, LaunchError, UsageError
from prefect_accelerate.launchers.engines import ENGINES, engine_for_route
from prefect_accelerate.launchers.host import HostProbe, local_host
from prefect_accelerate.launchers.plan import LaunchPlan


def choose_launcher(options, host: HostProbe | None = None) -> str:
    """Which launcher Accelerate's decision tree picks for these options (plus our CPU multi-process rule)."""
    if getattr(options, "kubernetes", False):
        return "kubernetes"  # ours: the whole launch becomes one Kubernetes Indexed Job (the engine plans each pod's launch)
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


def plan_launch(options, host: HostProbe | None = None, *, cwd: str | None = None) -> LaunchPlan:
    """The plan for these options on `host` (this machine by default). Starts nothing.

    Raises:
        UsageError, ConfigError: the options contradict each other. LaunchError: the plan cannot be made
        (a busy port, a missing MPI, a missing engine dependency). All exit 2: nothing started
        (docs/compatibility.md, "Exit codes").
    """
    try:
        return _plan_launch(options, host, cwd=cwd)
    except LaunchError as error:
        if error.exit_code == USAGE_EXIT_CODE:
            raise
        raise type(error)(error.message, exit_code=USAGE_EXIT_CODE) from None


def check_training_script(options, cwd: str | None = None) -> None:
    """Refuse a training script that is not there, before anything starts (also for --dry-run).

    Not for `--module` (a module name), a TPU pod (the script lives on the pod's machines) or a Kubernetes launch
    (the script lives in the image).
    """
    import shutil

    script = str(options.training_script)
    if options.module or getattr(options, "tpu_use_cluster", False) or getattr(options, "kubernetes", False):
        return  # a Kubernetes launch runs the script that is in the container image, not the one here
    path = os.path.join(cwd or os.getcwd(), os.path.expanduser(script))
    if options.no_python:
        if os.path.isfile(path) or (os.sep not in script and shutil.which(script)):
            return
        raise UsageError(f"The executable {script!r} (--no_python) was not found as a file or on PATH. Check the name, or drop --no_python to run a Python script.")
    if os.path.isdir(path):
        raise UsageError(f"The training script {script!r} is a folder. Pass the script file, or -m/--module to run a module.")
    if not os.path.isfile(path):
        raise UsageError(
            f"The training script {script!r} was not found (looked for {os.path.abspath(path)}). Check the path, "
            f"or pass -m/--module to run a module by name."
        )


def _plan_launch(options, host: HostProbe | None = None, *, cwd: str | None = None) -> LaunchPlan:
    from prefect_accelerate.launchers.state import new_run_dir

    machine = host or local_host()
    where = cwd or os.getcwd()
    run_dir = options.run_dir or str(new_run_dir())
    engine = engine_for_route(choose_launcher(options, machine))
    if engine.name != "sagemaker" and options.num_processes is None:
        # only a SageMaker config leaves the count unset (it sizes instances, not processes); a flag such as
        # --multi_gpu then sends the launch to this machine, which must know how many processes to start
        from prefect_accelerate.errors import ConfigError

        raise ConfigError(
            f"The config file {options.config_path} describes a SageMaker job (compute_environment: "
            f"AMAZON_SAGEMAKER), but the flags given send the launch to the {engine.name} launcher, and neither says "
            f"how many processes to start. Pass --num_processes N for a launch here, or drop the local-launch flags "
            f"to submit the SageMaker job."
        )
    return engine.planner()(options, machine, cwd=where, run_dir=run_dir)


__all__ = ["ENGINES", "LaunchPlan", "check_training_script", "choose_launcher", "plan_launch"]
