"""The Slurm plan: an sbatch script and the command each node runs, as pure data (no sbatch is called).

With torchrun (and DeepSpeed's `standard` launcher) the per-node command is the plan the torchrun or
DeepSpeed launcher makes for `--num_machines N --machine_rank R --main_process_ip HEAD
--main_process_port PORT`, with three values left to the job:
the node rank (`$SLURM_NODEID`), the head address (the first node of the allocation, its NodeAddr) and
the port (a free one, picked on the head node by the batch script before any node starts).

Files, both in the run folder (which must be on a filesystem the nodes share):
- `slurm.sbatch`: `#SBATCH` options, the cluster's setup lines, the head address and port, then one
  `srun` step with one task per node;
- `node.sh`: the per-node launch, its non-secret environment and working directory.
DeepSpeed's own `slurm` launcher is different (deepspeed_runner.py): the batch script writes a hostfile and
runs DeepSpeed's runner once, with the launch's environment; the runner starts every rank with its own srun.
Secret variables are never written: they reach the job through sbatch's own environment (sbatch
exports the submitting environment by default), and dry-run output shows them as ***.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass

from prefect_accelerate.errors import UsageError
from prefect_accelerate.launchers.host import HostProbe
from prefect_accelerate.launchers.plan import LaunchPlan

#: stand-ins the inner planner sees for values only the job knows; replaced by shell variables
HEAD_TOKEN = "__slurm_head_address__"
PORT_TOKEN = 65432
NODE_RANK = "${SLURM_NODEID}"
HEAD_VAR = "${PA_HEAD_ADDR}"
PORT_VAR = "${PA_PORT}"
SCRIPT_NAME = "slurm.sbatch"
NODE_SCRIPT_NAME = "node.sh"
OUTPUT_NAME = "slurm-%j.out"
#: DeepSpeed launches that run inside one allocation: `standard` (torchrun on every node) and DeepSpeed's own
#: `slurm` (its runner, once, in the batch script). The others start processes over ssh or MPI.
DEEPSPEED_KINDS = ("torchrun", "slurm")
_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class SlurmSettings:
    """The job's Slurm side: flags win over the cluster block, which wins over Slurm's defaults."""

    partition: str | None = None
    time: str | None = None
    account: str | None = None
    qos: str | None = None
    gpus_per_node: int | None = None
    sbatch_args: tuple[str, ...] = ()
    setup_lines: tuple[str, ...] = ()
    pending_timeout: float | None = None

    def sbatch_options(self, machines: int, job_name: str, output: str, tasks_per_node: int = 1) -> list[str]:
        opts = [f"--job-name={job_name}", f"--nodes={machines}", f"--ntasks-per-node={tasks_per_node}", f"--output={output}", "--no-requeue"]
        for flag, value in (("partition", self.partition), ("time", self.time), ("account", self.account), ("qos", self.qos)):
            if value:
                opts.append(f"--{flag}={value}")
        if self.gpus_per_node:
            opts.append(f"--gpus-per-node={self.gpus_per_node}")
        return [*opts, *self.sbatch_args]


def settings_from(options) -> SlurmSettings:
    """Merge the cluster block (when --slurm_block names one) under the flags."""
    block: dict = {}
    if options.slurm_block:
        from prefect_accelerate.launchers.engines.slurm.block import load_cluster_block

        block = load_cluster_block(options.slurm_block)
    sbatch_args = _split_args(options.slurm_sbatch_args, "--slurm_sbatch_args")
    return SlurmSettings(
        partition=options.slurm_partition or block.get("partition"),
        time=options.slurm_time or block.get("time"),
        account=options.slurm_account or block.get("account"),
        qos=options.slurm_qos or block.get("qos"),
        gpus_per_node=options.slurm_gpus_per_node if options.slurm_gpus_per_node is not None else block.get("gpus_per_node"),
        sbatch_args=(*block.get("sbatch_args", ()), *sbatch_args),
        setup_lines=tuple(block.get("setup_lines", ())),
        pending_timeout=options.slurm_pending_timeout if options.slurm_pending_timeout is not None else block.get("pending_timeout"),
    )


def _split_args(text: str | None, flag: str) -> tuple[str, ...]:
    if not text:
        return ()
    try:
        words = shlex.split(text)
    except ValueError as error:
        raise UsageError(f"{flag} {text!r} could not be split into sbatch options ({error}). Quote it as one string, e.g. "
                         f"{flag} \"--exclusive --mem=0\".") from None
    for word in words:
        if word.split("=", 1)[0] in ("--nodes", "-N", "--ntasks-per-node", "--output", "-o", "--parsable"):
            raise UsageError(f"{flag} sets {word.split('=', 1)[0]}, which prefect-accelerate sets itself from "
                             "--num_machines and the run folder. Remove it from {flag}.".replace("{flag}", flag))
    return tuple(words)


class _NodeHost(HostProbe):
    """The compute node as the inner planner sees it: ports are the job's business, GPUs are what was asked for."""

    def __init__(self, login: HostProbe, gpus_per_node: int | None) -> None:
        self.login = login
        self.gpus = gpus_per_node

    def __getattribute__(self, name: str):  # everything not overridden below comes from the login node's probe
        if name in ("login", "gpus", "port_in_use", "free_port", "accelerator_kind", "accelerator_count", "__class__", "__dict__"):
            return object.__getattribute__(self, name)
        return getattr(object.__getattribute__(self, "login"), name)

    def port_in_use(self, port: int, host: str = "localhost") -> bool:
        return False

    def free_port(self) -> int:
        return PORT_TOKEN

    def accelerator_kind(self) -> str | None:
        return "cuda" if self.gpus else (None if self.gpus == 0 else self.login.accelerator_kind())

    def accelerator_count(self) -> int:
        return int(self.gpus) if self.gpus is not None else self.login.accelerator_count()


def node_plan(options, host: HostProbe, cwd: str, run_dir: str) -> LaunchPlan:
    """The launch one node runs, with the stand-in head address, port and rank 0."""
    from prefect_accelerate.launchers import choose_launcher, plan_launch
    from prefect_accelerate.launchers.engines.torchrun import plan_torchrun

    machines = int(options.num_machines or 1)
    settings_gpus = options.slurm_gpus_per_node
    inner = options.with_changes(
        slurm=False, num_machines=machines, machine_rank=0, run_dir=run_dir,
        main_process_ip=HEAD_TOKEN if machines > 1 else None, main_process_port=PORT_TOKEN,
    )
    node = _NodeHost(host, settings_gpus)
    kind = choose_launcher(inner, node)
    if kind in ("tpu", "sagemaker"):
        raise UsageError(f"--slurm runs the launch on Slurm nodes, but these options select the {kind} launcher. Drop --slurm, "
                         "or use a config for GPUs or CPUs (multi_gpu, FSDP, DeepSpeed, --cpu).")
    if kind == "simple" and (machines > 1 or int(inner.num_processes or 1) > 1):
        # several machines always need torchrun; without GPUs asked for, the nodes run gloo on CPU
        gpus = node.accelerator_kind() not in (None, "mps")
        return plan_torchrun(inner, node, cwd, run_dir, cpu=not gpus)
    ds_kind = None
    if kind == "deepspeed":
        from prefect_accelerate.launchers.engines.deepspeed.plan import launcher_kind

        ds_kind = launcher_kind(inner)  # checked before planning: the others look for pdsh, mpirun or sinfo here
    if ds_kind not in (None, *DEEPSPEED_KINDS):
        raise UsageError(
            f"deepspeed_multinode_launcher {ds_kind} is not supported with --slurm (it starts the "
            "processes itself, over ssh or MPI); inside a Slurm job use `standard`, which runs torchrun with "
            "DeepSpeed's environment on every node, or `slurm`, DeepSpeed's own srun launch. Set "
            "--deepspeed_multinode_launcher standard (or slurm), or change it in the config file."
        )
    if ds_kind == "slurm":
        from prefect_accelerate.launchers.engines.slurm.deepspeed_runner import runner_plan

        return runner_plan(inner, node, cwd=cwd, run_dir=run_dir, gpus_per_node=settings_gpus)
    return plan_launch(inner, node, cwd=cwd)


def _shell_word(arg: str) -> str:
    """Quote for bash, keeping the job's variables (${...}) expandable."""
    if "${" not in arg:
        return shlex.quote(arg)
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`") + '"'


def per_node_argv(plan: LaunchPlan, run_dir: str) -> list[str]:
    """The inner plan's argv with the job's node rank, head address and port."""
    argv = list(plan.argv)
    out: list[str] = []
    for i, arg in enumerate(argv):
        previous = argv[i - 1] if i else ""
        if previous == "--node_rank":
            arg = NODE_RANK
        elif previous == "--master_port" and arg == str(PORT_TOKEN):
            arg = PORT_VAR
        elif previous == "--log_dir" and arg == os.path.join(run_dir, "ranks"):
            arg = os.path.join(run_dir, "ranks", "node-" + NODE_RANK)  # every node writes its own rank folders
        arg = arg.replace(f"{HEAD_TOKEN}:{PORT_TOKEN}", f"{HEAD_VAR}:{PORT_VAR}").replace(HEAD_TOKEN, HEAD_VAR)
        out.append(arg)
    return out


def launch_lines(plan: LaunchPlan, argv: list[str], cwd: str, run_dir: str) -> list[str]:
    """The plan's non-secret environment, its working directory and its command, as bash lines."""
    lines = []
    for name, value in plan.env.items():
        if plan.is_secret(name):
            continue  # carried by sbatch's environment, never written down
        if name == "TORCHELASTIC_ERROR_FILE":
            value = os.path.join(run_dir, f"error-node-{NODE_RANK}.json")
        lines.append(f"export {name}={_shell_word(value)}")
    return [*lines, f"cd {shlex.quote(cwd)} || exit 2", "exec " + " ".join(_shell_word(a) for a in argv)]


def node_script(plan: LaunchPlan, argv: list[str], cwd: str, run_dir: str) -> str:
    lines = ["#!/bin/bash", "# prefect-accelerate: the launch each node runs (srun starts it once per node)"]
    return "\n".join([*lines, *launch_lines(plan, argv, cwd, run_dir), ""])


def _port_program() -> str:
    import inspect

    from prefect_accelerate.launchers import ports

    return inspect.getsource(ports)


def batch_script(settings: SlurmSettings, machines: int, job_name: str, run_dir: str, python: str, step_lines: list[str],
                 tasks_per_node: int = 1) -> str:
    output = os.path.join(run_dir, OUTPUT_NAME)
    lines = ["#!/bin/bash", *(f"#SBATCH {opt}" for opt in settings.sbatch_options(machines, job_name, output, tasks_per_node))]
    lines += ["# written by prefect-accelerate: setup lines, then the head node's address and a free port there, then one step"]
    lines += list(settings.setup_lines)
    lines += [
        'PA_HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        # node names need not resolve (NodeAddr may differ from NodeName): ask Slurm for the address
        "PA_HEAD_ADDR=$(scontrol show node \"$PA_HEAD_NODE\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p' | head -n 1)",
        'PA_HEAD_ADDR=${PA_HEAD_ADDR:-$PA_HEAD_NODE}',
        # picked on the head node, from below its kernel's ephemeral range: launchers/ports.py's own source, run by
        # the job's Python (the package need not be installed where the job runs)
        f"PA_PORT=$({shlex.quote(python)} - <<'PA_PORT_PY'",
        *_port_program().splitlines(),
        "print(rendezvous_port())",
        "PA_PORT_PY",
        ")",
        "export PA_HEAD_ADDR PA_PORT",
        'echo "[prefect-accelerate] job $SLURM_JOB_ID on $SLURM_JOB_NODELIST; head node $PA_HEAD_NODE at $PA_HEAD_ADDR:$PA_PORT"',
        *step_lines,
        "",
    ]
    return "\n".join(lines)


def plan(options, host: HostProbe, *, cwd: str, run_dir: str | None) -> LaunchPlan:
    """The Slurm plan: `sbatch --parsable <run_dir>/slurm.sbatch`, with both scripts as files of the plan.

    Raises:
        UsageError: options that cannot run under Slurm (a TPU or SageMaker config, an ssh-based DeepSpeed
        launcher, sbatch options prefect-accelerate sets itself).
    """
    from prefect_accelerate.launchers.state import new_run_dir

    run_dir = os.path.abspath(run_dir or str(new_run_dir("slurm")))
    machines = int(options.num_machines or 1)
    settings = settings_from(options)
    inner = node_plan(options.with_changes(slurm_gpus_per_node=settings.gpus_per_node), host, cwd, run_dir)
    job_name = "pa-" + (_SAFE_NAME.sub("-", os.path.splitext(os.path.basename(options.training_script))[0]) or "launch")
    if inner.launcher == "deepspeed-slurm":
        return _runner_job(inner, settings, host, machines, job_name, cwd, run_dir)
    node_path = os.path.join(run_dir, NODE_SCRIPT_NAME)
    script_path = os.path.join(run_dir, SCRIPT_NAME)
    step = ["srun", f"--nodes={machines}", f"--ntasks={machines}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            "--label", "bash", node_path]
    argv = per_node_argv(inner, run_dir)
    files = {node_path: node_script(inner, argv, cwd, run_dir),
             script_path: batch_script(settings, machines, job_name, run_dir, host.python(), [" ".join(shlex.quote(a) for a in step)])}
    for path, content in inner.files.items():
        files[path if os.path.isabs(path) else os.path.join(run_dir, path)] = content
    shown = " ".join(_shell_word(a) for a in argv)
    nodes = [{"node_rank": rank, "command": shown.replace(f'"{NODE_RANK}"', str(rank)).replace(NODE_RANK, str(rank))} for rank in range(machines)]
    secret = {k: v for k, v in inner.env.items() if inner.is_secret(k)}
    return LaunchPlan(
        launcher="slurm",
        argv=("sbatch", "--parsable", script_path),
        env=secret,
        cwd=cwd,
        secret_env=inner.secret_env,
        num_processes=int(inner.num_processes),
        num_machines=machines,
        run_dir=run_dir,
        warnings=inner.warnings,
        notes=(*inner.notes, f"Each node runs the {inner.launcher} launch below; the head address and port are chosen in the job."),
        files=files,
        request={
            "job_name": job_name, "node_launcher": inner.launcher, "sbatch_options": settings.sbatch_options(machines, job_name, os.path.join(run_dir, OUTPUT_NAME)),
            "setup_lines": list(settings.setup_lines), "pending_timeout": settings.pending_timeout, "nodes": nodes,
        },
    )


def _runner_job(inner: LaunchPlan, settings: SlurmSettings, host: HostProbe, machines: int, job_name: str, cwd: str,
                run_dir: str) -> LaunchPlan:
    """The plan for DeepSpeed's `slurm` launcher: the batch script writes the hostfile and runs DeepSpeed's runner once."""
    from prefect_accelerate.launchers.engines.slurm.deepspeed_runner import hostfile_line

    per_node = int(inner.num_processes) // machines
    output = os.path.join(run_dir, OUTPUT_NAME)
    script_path = os.path.join(run_dir, SCRIPT_NAME)
    steps = [hostfile_line(run_dir, per_node), *launch_lines(inner, list(inner.argv), cwd, run_dir)]
    files = {**inner.files, script_path: batch_script(settings, machines, job_name, run_dir, host.python(), steps, per_node)}
    return LaunchPlan(
        launcher="slurm", argv=("sbatch", "--parsable", script_path),
        env={k: v for k, v in inner.env.items() if inner.is_secret(k)}, cwd=cwd, secret_env=inner.secret_env,
        num_processes=int(inner.num_processes), num_machines=machines, run_dir=run_dir, warnings=inner.warnings,
        notes=(*inner.notes, "The batch script runs DeepSpeed's runner once; the head address and port are chosen in the job."),
        files=files,
        request={
            "job_name": job_name, "node_launcher": inner.launcher,
            "sbatch_options": settings.sbatch_options(machines, job_name, output, per_node),
            "setup_lines": list(settings.setup_lines), "pending_timeout": settings.pending_timeout,
            "command": " ".join(_shell_word(a) for a in inner.argv),
        },
    )
