"""TPU launches (reference §4.3.4): one TPU host, or every worker of a TPU VM pod.

Single host (`--tpu`): a local process, `python -m prefect_accelerate.launchers.engines.tpu.runner`, imports the
script and runs its main function through torch_xla's launcher (runner.py). The environment is
Accelerate's: ACCELERATE_DEBUG_MODE with --debug, XLA_USE_BF16 / XLA_DOWNCAST_BF16 for bf16 on a TPU
(decided by the runner, which can ask torch_xla whether it is on a TPU).

Pod (`--tpu_cluster`, or `tpu_use_cluster` in the config): Accelerate hands the launch to torch_xla's
`xla_dist`, which newer torch_xla no longer ships. We build the gcloud commands ourselves and run them
through a small driver (pod.py) that the plan starts as a local process:

1. optionally `gcloud compute tpus tpu-vm scp --recurse <stage> NAME:~/ --worker all` (the script, and a
   file with the variables that must not travel on a command line);
2. `gcloud compute tpus tpu-vm ssh NAME --zone Z --command "<cd; exec env ... prefect-accelerate launch
   --tpu --no_tpu_cluster ...>" --worker all`, which runs the single-host launch on every worker;
3. on cancellation, `... ssh ... --command "kill -TERM <the pid each worker recorded>"`.

Differences from Accelerate (docs/compatibility.md): the user's `--env` / `tpu_env` values reach the
workers (Accelerate replaces them); the workers get the real `--mixed_precision` and decide bf16 on their
own TPU (Accelerate sends `no` plus bf16 variables computed on the launching machine, which is rarely a
TPU); a cancelled launch stops the remote processes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
from pathlib import Path

from prefect_accelerate.config.model import as_bool
from prefect_accelerate.errors import DependencyError, UsageError
from prefect_accelerate.launchers import environment as blocks
from prefect_accelerate.secrets import is_secret_name
from prefect_accelerate.launchers.engines.tpu.gcloud import TPU_BLOCK_ENV, TpuPod, resolve_pod, scp_argv, ssh_argv
from prefect_accelerate.launchers.host import HostProbe
from prefect_accelerate.launchers.plan import LaunchPlan

RUNNER_MODULE = "prefect_accelerate.launchers.engines.tpu.runner"
POD_DRIVER_MODULE = "prefect_accelerate.launchers.engines.tpu.pod"
#: the driver's instructions, written into the run folder before the launch
POD_SPEC_FILE = "tpu-pod.json"
#: where each worker records the pid of its launch (so a cancelled launch can stop it)
REMOTE_STATE_DIR = "~/.cache/prefect-accelerate"
#: the command the workers run; prefect-accelerate must be installed there (`tpu-config --install_prefect_accelerate`)
REMOTE_PROGRAM = "prefect-accelerate"
ENV_FILE = ".env"

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def bf16_mode(options) -> str | None:
    """`use` (XLA_USE_BF16) or `downcast` (XLA_DOWNCAST_BF16) for bf16 launches, else None."""
    if str(options.mixed_precision or "no").lower() != "bf16":
        return None
    return "downcast" if as_bool(options.downcast_bf16 or False) else "use"


def plan(options, host: HostProbe, *, cwd: str, run_dir: str | None, pod: TpuPod | None = None,
         copy_script: bool | None = None) -> LaunchPlan:
    """The plan for a `--tpu` launch: this host, or every worker of a pod with `--tpu_cluster`.

    Args:
        pod: where the pod is (Python callers); otherwise from options, a TpuPodBlock, or the config.
        copy_script: copy the script to every worker first (pods only).

    Raises:
        UsageError: --no_python, a pod without name or zone, a malformed --env entry.
        DependencyError: a single-host launch on a machine without torch_xla.
    """
    if options.no_python:
        raise UsageError("--no_python cannot be used with --tpu: the TPU launcher imports a Python script or module (-m).")
    if as_bool(options.tpu_use_cluster or False):
        return plan_pod(options, host, cwd=cwd, run_dir=run_dir, pod=pod, copy_script=copy_script)
    return plan_single_host(options, host, cwd=cwd, run_dir=run_dir)


def plan_single_host(options, host: HostProbe, *, cwd: str, run_dir: str | None) -> LaunchPlan:
    if importlib.util.find_spec("torch_xla") is None:
        raise DependencyError.missing("torch_xla", "tpu", "Launching on a TPU (--tpu)")
    function = options.main_training_function or "main"
    argv = [host.python(), "-m", RUNNER_MODULE, "--main_training_function", str(function)]
    if options.module:
        argv.append("--module")
    notes = list(options.notes)
    mode = bf16_mode(options)
    if mode:
        argv += ["--bf16", mode]
        variable = "XLA_DOWNCAST_BF16" if mode == "downcast" else "XLA_USE_BF16"
        notes.append(f"bf16: {variable}=1 is set for the training processes when torch_xla reports a TPU (as in Accelerate).")
    argv += ["--", options.training_script, *options.training_script_args]
    env = blocks.debug_env(options) | blocks.unbuffered_env()
    return LaunchPlan(
        launcher="tpu", argv=tuple(argv), env=env, cwd=cwd, num_processes=int(options.num_processes or 1),
        num_machines=1, run_dir=run_dir, warnings=tuple(w for w in [options.defaults_warning] if w), notes=tuple(notes),
    )


def _launch_id(run_dir: str | None) -> str:
    name = Path(run_dir).name if run_dir else "launch"
    return re.sub(r"[^A-Za-z0-9._-]", "-", name) or "launch"


def _split_env(entries: list[str]) -> tuple[dict[str, str], dict[str, str | None]]:
    """(inline NAME->value, forwarded NAME->value or None) from `--env` / `tpu_env` entries, later ones winning.

    Forwarded variables travel in a file copied to the workers, never on a command line: secrets
    (`HF_TOKEN=...`), and bare names (`--env WANDB_API_KEY`), whose value is this machine's at launch time.
    """
    inline: dict[str, str] = {}
    forwarded: dict[str, str | None] = {}
    for entry in entries:
        name, has_value, value = entry.partition("=")
        name = name.strip()
        if not _NAME.match(name):
            raise UsageError(
                f"--env {entry!r} (or a tpu_env entry in the config) is not NAME=VALUE with a valid variable name. "
                "Write it as --env NAME=VALUE, or --env NAME to pass this machine's value of NAME."
            )
        inline.pop(name, None)
        forwarded.pop(name, None)
        if has_value and not is_secret_name(name):
            inline[name] = value
        else:
            forwarded[name] = value if has_value else None
    return inline, forwarded


def remote_launch_argv(options, script: str) -> list[str]:
    """What each worker runs: the single-host launch, as Accelerate's pod launcher asks for it."""
    argv = [REMOTE_PROGRAM, "launch", "--no-track", "--tpu", "--no_tpu_cluster", "--num_machines", "1",
            "--mixed_precision", str(options.mixed_precision or "no"), "--dynamo_backend", "no"]
    if options.num_processes:
        argv += ["--num_processes", str(options.num_processes)]
    argv += ["--main_training_function", str(options.main_training_function or "main")]
    if as_bool(options.downcast_bf16 or False):
        argv.append("--downcast_bf16")
    if options.debug:
        argv.append("--debug")
    if options.module:
        argv.append("--module")
    return [*argv, script, *options.training_script_args]


def plan_pod(options, host: HostProbe, *, cwd: str, run_dir: str | None, pod: TpuPod | None = None,
             copy_script: bool | None = None) -> LaunchPlan:
    if pod is None:
        given = options.is_given
        pod = resolve_pod(
            name=options.tpu_name if given("tpu_name") else None,
            zone=options.tpu_zone if given("tpu_zone") else None,
            project=getattr(options, "tpu_project", None),
            block=getattr(options, "tpu_block", None) or os.environ.get(TPU_BLOCK_ENV) or None,
            config_name=options.tpu_name, config_zone=options.tpu_zone, what="the TPU pod (--tpu_cluster)",
        )
    copy = bool(copy_script if copy_script is not None else getattr(options, "tpu_copy_script", False))
    run_folder = run_dir or os.path.join(cwd, ".prefect-accelerate")
    launch_id = _launch_id(run_folder)
    warnings = [w for w in [options.defaults_warning] if w]
    notes = list(options.notes)
    vms = [vm for vm in (options.vm or options.tpu_vm or []) if vm and vm.strip()]
    if vms:
        warnings.append(
            f"--vm / tpu_vm ({', '.join(vms)}) is not used: xla_dist's VM-group mode is gone from torch_xla; the pod "
            f"{pod.name} is reached with `gcloud compute tpus tpu-vm ssh --worker all`."
        )
    inline, forwarded = _split_env([e for e in [*(options.tpu_env or []), *(options.env or [])] if e and e.strip()])
    inline["ACCELERATE_IN_TPU_POD"] = "1"
    inline |= blocks.debug_env(options)

    if copy and options.module:
        notes.append("--module: nothing is copied to the workers; the module must be installed there.")
        copy = False
    script_path = Path(cwd, options.training_script)
    if copy and not script_path.is_file():
        raise UsageError(f"The training script {script_path} does not exist, so it cannot be copied to the pod's workers.")
    stage_name = f"prefect-accelerate-{launch_id}"
    staged = copy or bool(forwarded)
    remote_dir = f"~/{stage_name}" if copy else shlex.quote(cwd)
    script = script_path.name if copy else options.training_script

    pid_file = f"{REMOTE_STATE_DIR}/tpu-pod-{launch_id}.pid"
    parts = [f"mkdir -p {REMOTE_STATE_DIR}", f"echo $$ > {pid_file}", f"cd {remote_dir}"]
    if forwarded:
        env_file = f"~/{stage_name}/{ENV_FILE}"
        parts += [f". {env_file}", f"rm -f {env_file}"]
    sudo = as_bool(options.tpu_use_sudo or False)
    prefix = "exec "
    if sudo:
        prefix += "sudo " + (f"--preserve-env={','.join(forwarded)} " if forwarded else "")
    prefix += "env " + " ".join(shlex.quote(f"{k}={v}") for k, v in inline.items()) + " "
    remote = " && ".join([*parts, prefix + shlex.join(remote_launch_argv(options, script))])
    stop = f"{'sudo ' if sudo else ''}kill -TERM $(cat {pid_file} 2>/dev/null) 2>/dev/null; rm -f {pid_file}; true"

    steps: list[list[str]] = []
    if staged:
        steps.append(scp_argv(pod, [os.path.join(run_folder, stage_name)], "~/", recurse=True))
    steps.append(ssh_argv(pod, remote))
    spec = {
        "launch_id": launch_id,
        "pod": pod.model_dump(),
        "stage": {
            "dir": os.path.join(run_folder, stage_name),
            "copy": [str(script_path.resolve())] if copy else [],
            "env_file": ENV_FILE if forwarded else None,
            "forward_env": list(forwarded),
        } if staged else None,
        "steps": steps,
        "stop": ssh_argv(pod, stop),
    }
    secret_values = {k: v for k, v in forwarded.items() if v is not None}
    if forwarded:
        notes.append(
            f"{', '.join(forwarded)} reach the workers in a file copied with scp (removed once read), not on a command line."
        )
    missing_program = f"{REMOTE_PROGRAM} must be installed on every worker (`prefect-accelerate tpu-config --install_prefect_accelerate`)."
    notes.append(missing_program)
    return LaunchPlan(
        launcher="tpu-pod",
        argv=(host.python(), "-m", POD_DRIVER_MODULE, os.path.join(run_folder, POD_SPEC_FILE)),
        env=secret_values | blocks.unbuffered_env(),
        secret_env=frozenset(secret_values),
        cwd=cwd,
        num_processes=int(options.num_processes or 1),
        num_machines=int(options.num_machines or 1),
        run_dir=run_folder,
        warnings=tuple(warnings),
        notes=tuple(notes),
        files={POD_SPEC_FILE: json.dumps(spec, indent=2) + "\n"},
    )
