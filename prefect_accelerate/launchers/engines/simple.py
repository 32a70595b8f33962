"""The simple launcher: one `python script.py` process, or `mpirun ... python script.py` (reference §4.3.1)."""

from __future__ import annotations


from prefect_accelerate.errors import LaunchError, UsageError
from prefect_accelerate.launchers import environment as blocks
from prefect_accelerate.launchers.host import HostProbe
from prefect_accelerate.launchers.plan import LaunchPlan

#: flavour -> (hostfile flag, per-node flag, process-count flag, bind flag)
MPI_FLAGS = {
    "openmpi": ("--hostfile", "--npernode", "-n", "--bind-to"),
    "other": ("-f", "-ppn", "-n", None),  # Intel MPI, MPICH, MVAPICH
}


def mpirun_prefix(options, host: HostProbe) -> list[str]:
    """`mpirun --hostfile F --npernode K -n N --bind-to socket` (Open MPI) or the Intel MPI/MVAPICH form."""
    program = next((p for p in ("mpirun", "mpiexec") if host.which(p)), None)
    if program is None:
        raise LaunchError(
            f"mpirun_hostfile is set ({options.mpirun_hostfile}) but neither mpirun nor mpiexec is on PATH. Install "
            "an MPI (Open MPI, Intel MPI or MVAPICH), or remove mpirun_hostfile to start a single process."
        )
    flavour = "openmpi" if "Open MPI" in host.command_output([program, "--version"]) else "other"
    hostfile_flag, per_node_flag, count_flag, bind_flag = MPI_FLAGS[flavour]
    processes, machines = options.num_processes, options.num_machines
    per_node = str(processes // machines) if processes and machines else "1"
    argv = [program, hostfile_flag, str(options.mpirun_hostfile), per_node_flag, per_node]
    if processes:
        argv += [count_flag, str(processes)]
    if bind_flag:
        argv += [bind_flag, "socket"]
    return argv


def script_argv(options, host: HostProbe) -> list[str]:
    argv: list[str] = []
    if not options.no_python:
        argv.append(host.python())
        if options.module:
            argv.append("-m")
    return [*argv, options.training_script, *options.training_script_args]


def plan(options, host: HostProbe, *, cwd: str, run_dir: str | None) -> LaunchPlan:
    """The script as one process (or under mpirun with --mpirun_hostfile), with Accelerate's environment."""
    if options.no_python and options.module:
        raise UsageError("--module and --no_python cannot be used together.")
    argv: list[str] = []
    launcher = "simple"
    if options.mpirun_hostfile is not None:
        argv += mpirun_prefix(options, host)
        launcher = "mpirun"
    argv += script_argv(options, host)
    use_cpu = bool(options.cpu or options.use_cpu)
    env: dict[str, str] = {"ACCELERATE_USE_CPU": str(use_cpu)}
    env |= blocks.debug_env(options)
    env |= blocks.visible_devices_env(options, host)
    machines = int(options.num_machines)
    if machines > 1 and (options.main_process_ip is None or options.main_process_port is None):
        raise UsageError(
            f"num_machines is {machines}, so every machine needs the address of the main one: pass "
            "--main_process_ip and --main_process_port (or set them in the config file)."
        )
    if (options.num_processes is not None and options.num_processes > 1) or machines > 1:
        env["MASTER_ADDR"] = options.main_process_ip if options.main_process_ip is not None else "127.0.0.1"
        env["MASTER_PORT"] = str(options.main_process_port) if options.main_process_port is not None else "29500"
    if use_cpu:
        env |= blocks.cpu_kmp_env()
    env |= blocks.mixed_precision_env(options)
    env |= blocks.fp8_env(options, host)
    env |= blocks.dynamo_env(options)
    env |= blocks.threads_env(options)
    env |= blocks.cpu_affinity_env(options)
    env |= blocks.unbuffered_env()
    return LaunchPlan(
        launcher=launcher,
        argv=tuple(argv),
        env=env,
        cwd=cwd,
        num_processes=int(options.num_processes or 1),
        num_machines=machines,
        machine_rank=int(options.machine_rank or 0),
        run_dir=run_dir,
        warnings=tuple(w for w in [options.defaults_warning] if w),
        notes=options.notes,
    )
