"""Several processes through `python -m torch.distributed.run`, started as a subprocess we own.

Accelerate runs torchrun inside its own process (reference §4.3.2); we run the same torchrun
arguments as a child, so that it can be supervised, streamed and ended as a whole. MULTI_GPU, FSDP,
Megatron-LM, the parallelism config, CPU multi-process runs and DeepSpeed's standard launcher all
come through here.
"""

from __future__ import annotations

import os

from prefect_accelerate.errors import LaunchError, UsageError
from prefect_accelerate.launchers import environment as blocks
from prefect_accelerate.launchers.host import HostProbe
from prefect_accelerate.launchers.plan import LaunchPlan

DEFAULT_PORT = 29500
#: torchrun's rank prefix when --tee is on; our default so every log line carries its rank
DEFAULT_TEE = "3"


def resolve_port(options, host: HostProbe) -> tuple[int, list[str]]:
    """The master port: 0 picks a free one; a busy port is an error before anything starts.

    The one exception is the implicit default (29500, never asked for) on a single machine: then a free
    port is picked and a note says so (Accelerate switches torchrun to --standalone there).
    """
    notes: list[str] = []
    port = options.main_process_port
    machines = int(options.num_machines)
    if port == 0:
        if machines > 1 and int(options.machine_rank or 0) != 0:
            raise UsageError(
                "--main_process_port 0 picks a free port on this machine, but this is machine rank "
                f"{int(options.machine_rank or 0)}: it must use the port the main machine listens on. Pass that port "
                "(multinode_launch chooses it on machine 0 and passes it to the others)."
            )
        port = host.free_port()
        notes.append(f"--main_process_port 0: using free port {port}" + (" (tell the other machines)." if machines > 1 else "."))
        return port, notes
    explicit = port is not None
    port = int(port) if explicit else DEFAULT_PORT
    if machines <= 1 or int(options.machine_rank or 0) == 0:
        check_host = "localhost"
        if host.port_in_use(port, check_host):
            if not explicit and machines <= 1:
                free = host.free_port()
                notes.append(f"The default port {port} is in use on this machine; using free port {free} instead.")
                return free, notes
            raise LaunchError(
                f"Port {port} on this machine is already in use, so the main process could not listen on it. Pass "
                "another --main_process_port (or main_process_port in the config), or 0 to pick a free port on a "
                "single machine."
            )
    return port, notes


def torchrun_arguments(options, host: HostProbe, run_dir: str | None) -> tuple[list[str], list[str]]:
    """The torchrun flags Accelerate fills in (plus our rank-labelled output defaults) and notes."""
    if options.module and options.no_python:
        raise UsageError("--module and --no_python cannot be used together.")
    port, notes = resolve_port(options, host)
    processes, machines = int(options.num_processes), int(options.num_machines)
    args: list[str] = []
    if machines > 1:
        if options.main_process_ip is None:
            raise UsageError(
                f"num_machines is {machines}: pass --main_process_ip (the address of the machine of rank 0) so every "
                "machine can find it."
            )
        if processes % machines:
            notes.append(
                f"num_processes {processes} is not a multiple of num_machines {machines}: each machine starts "
                f"{processes // machines} (as Accelerate does)."
            )
        args += ["--nproc_per_node", str(processes // machines), "--nnodes", str(machines), "--node_rank", str(int(options.machine_rank or 0))]
        if options.same_network:
            args += ["--master_addr", str(options.main_process_ip), "--master_port", str(port)]
        else:
            args += ["--rdzv_endpoint", f"{options.main_process_ip}:{port}"]
    else:
        args += ["--nproc_per_node", str(processes), "--master_port", str(port)]
    args += ["--rdzv_backend", str(options.rdzv_backend)]
    if options.rdzv_conf:
        args += ["--rdzv_conf", str(options.rdzv_conf)]
    args += ["--max_restarts", str(options.max_restarts), "--monitor_interval", str(options.monitor_interval), "--role", str(options.role)]
    # ours (docs/compatibility.md): per-rank logs in the run folder instead of torchrun's stray temp
    # folders, and rank-prefixed console lines so each log line can carry its rank
    tee, log_dir = options.tee, options.log_dir
    if run_dir is not None:
        if not options.is_given("tee") and options.tee == "0":
            tee = DEFAULT_TEE
        if not log_dir:
            log_dir = os.path.join(run_dir, "ranks")
    args += ["--tee", str(tee)]
    if log_dir:
        args += ["--log_dir", str(log_dir)]
    if options.module:
        args.append("--module")
    elif options.no_python:
        args.append("--no_python")
    return args, notes


def multi_process_env(options, host: HostProbe, *, cpu: bool) -> tuple[dict[str, str], list[str]]:
    """Accelerate's `prepare_multi_gpu_env` additions, plus ACCELERATE_USE_CPU for CPU runs."""
    env: dict[str, str] = {}
    env |= blocks.debug_env(options)
    env |= blocks.visible_devices_env(options, host)
    env |= blocks.mixed_precision_env(options)
    env |= blocks.fp8_env(options, host)
    env |= blocks.dynamo_env(options)
    env |= blocks.fsdp_env(options)
    env |= blocks.megatron_env(options)
    env |= blocks.threads_env(options)
    env |= blocks.cpu_affinity_env(options)
    env |= blocks.parallelism_env(options)
    warnings: list[str] = []
    guard, warning = blocks.nccl_guard_env(host, dict(os.environ))
    env |= guard
    if warning:
        warnings.append(warning)
    if cpu:
        # ours: without it each worker's Accelerator() believes it is alone (spike §5.1)
        env["ACCELERATE_USE_CPU"] = "True"
        env |= blocks.cpu_kmp_env()  # as Accelerate's simple launcher (its --cpu path) sets them
    return env, warnings


def plan(options, host: HostProbe, *, cwd: str, run_dir: str | None) -> LaunchPlan:
    """The torchrun plan for these options: on CPU with gloo when asked (--cpu, use_cpu) or when the host has
    no accelerator torchrun can use (none, or Apple's MPS), else on the host's devices."""
    cpu = bool(options.cpu or options.use_cpu) or host.accelerator_kind() in (None, "mps")
    return plan_torchrun(options, host, cwd, run_dir, cpu=cpu)


def plan_torchrun(options, host: HostProbe, cwd: str, run_dir: str | None, *, cpu: bool, extra_env: dict[str, str] | None = None, launcher: str = "torchrun") -> LaunchPlan:
    args, notes = torchrun_arguments(options, host, run_dir)
    env, warnings = multi_process_env(options, host, cpu=cpu) if extra_env is None else ({}, [])
    if extra_env is not None:
        env = dict(extra_env)
    env |= blocks.unbuffered_env()
    if run_dir is not None:
        # torchrun copies the failing worker's root cause here (spike §4.3)
        env["TORCHELASTIC_ERROR_FILE"] = os.path.join(run_dir, "error.json")
    argv = [host.python(), "-m", "torch.distributed.run", *args, options.training_script, *options.training_script_args]
    if options.defaults_warning:
        warnings.insert(0, options.defaults_warning)
    return LaunchPlan(
        launcher=launcher,
        argv=tuple(argv),
        env=env,
        cwd=cwd,
        num_processes=int(options.num_processes),
        num_machines=int(options.num_machines),
        machine_rank=int(options.machine_rank or 0),
        run_dir=run_dir,
        warnings=tuple(warnings),
        notes=tuple(options.notes) + tuple(notes),
        implicit_port=options.main_process_port is None and int(options.num_machines) <= 1,
    )
