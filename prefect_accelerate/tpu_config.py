"""`tpu-config`: run set-up commands on every worker of a TPU VM pod (reference §2.7, §8).

The command is Accelerate's: `gcloud [alpha] compute tpus tpu-vm ssh NAME --zone Z --command "cd
/usr/share; [pip install ...;] <commands>" --worker all`, and `--debug` prints `Running <argv joined by
spaces>` exactly as Accelerate does. Fixed (docs/compatibility.md, reference §13.14):

- `--command echo hello` is one command (`echo hello`), not two (`echo; hello`);
- a missing pod name or zone is an error that says where to set it (Accelerate: TypeError or a gcloud
  failure);
- gcloud's exit code is checked: a failure is a LaunchError with gcloud's last lines, and "Successfully
  setup pod." is printed only after a success;
- blank lines of a command file are skipped (Accelerate joins them into `; ;`, a shell syntax error);
- `--accelerate_version` that is neither `latest`, `dev` nor a version is a usage error, not a traceback;
- `--command` together with `--command_file` is an error (Accelerate silently drops the `--command`s).

Ours on top: `--install_prefect_accelerate [--prefect_accelerate_version]` (the pod launcher runs
`prefect-accelerate launch` on each worker), `--tpu_project`, and a `TpuPodBlock` for the pod's location.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from prefect_accelerate.errors import LaunchError, UsageError
from prefect_accelerate.launchers.engines.tpu.gcloud import TpuPod, resolve_pod, ssh_argv

ACCELERATE_DEV = "git+https://github.com/huggingface/accelerate.git"
#: gcloud must never wait for an answer nobody can give (e.g. an SSH key passphrase) under a supervisor
GCLOUD_ENV = {"CLOUDSDK_CORE_DISABLE_PROMPTS": "1"}


def _is_version(text: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        Version(text)
    except InvalidVersion:
        return False
    return True


def accelerate_requirement(version: str) -> str:
    """What `pip install` gets for `--accelerate_version`: `accelerate -U`, the git URL, or `accelerate==X`."""
    if version == "dev":
        return ACCELERATE_DEV
    if version == "latest":
        return "accelerate -U"
    if _is_version(version):
        return f"accelerate=={version}"
    raise UsageError(
        f"--accelerate_version {version!r} is not a version. Use `latest`, `dev` (Accelerate's main branch) or a "
        "release number such as 1.16.0."
    )


def prefect_accelerate_requirement(version: str) -> str:
    """`prefect-accelerate -U`, `prefect-accelerate==X`, or a wheel path / URL passed through as given."""
    if version == "latest":
        return "prefect-accelerate -U"
    if _is_version(version):
        return f"prefect-accelerate=={version}"
    if "/" in version or version.endswith(".whl"):
        return version
    raise UsageError(
        f"--prefect_accelerate_version {version!r} is not a version. Use `latest`, a release number such as 0.1.0, "
        "or the path or URL of a wheel that is reachable from the pod."
    )


class TpuConfigRequest(BaseModel):
    """What `tpu-config` runs: where, and the shell commands (already flattened, one per entry)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pod: TpuPod
    commands: tuple[str, ...]
    install_accelerate: bool = False
    accelerate_version: str = "latest"
    install_prefect_accelerate: bool = False
    prefect_accelerate_version: str = "latest"

    def remote_script(self) -> str:
        parts = ["cd /usr/share"]
        if self.install_accelerate:
            parts.append(f"pip install {accelerate_requirement(self.accelerate_version)}")
        if self.install_prefect_accelerate:
            parts.append(f"pip install {prefect_accelerate_requirement(self.prefect_accelerate_version)}")
        return "; ".join([*parts, *self.commands])

    def argv(self) -> list[str]:
        return ssh_argv(self.pod, self.remote_script())

    def debug_line(self) -> str:
        """Accelerate's `--debug` output: `Running ` and the argv joined by single spaces (not shell-quoted)."""
        return f"Running {' '.join(self.argv())}"


class TpuConfigResult(BaseModel):
    """How a `tpu-config` run ended."""

    pod: str
    zone: str
    command: list[str]
    exit_code: int
    duration_s: float
    log_path: str | None = None
    tail: list[str] = Field(default_factory=list)

    @property
    def succeeded(self) -> bool:
        return self.exit_code == 0


def flatten_commands(command: Sequence[str | Sequence[str]] | None) -> list[str]:
    """`--command` values: each occurrence is one command, its words joined by spaces."""
    out: list[str] = []
    for item in command or []:
        text = item if isinstance(item, str) else " ".join(item)
        if text.strip():
            out.append(text)
    return out


def read_command_file(path: str | os.PathLike[str]) -> list[str]:
    file = Path(path).expanduser()
    try:
        lines = file.read_text().splitlines()
    except FileNotFoundError:
        raise UsageError(f"The command file {file} does not exist (working directory {os.getcwd()}). Check --command_file "
                         "or command_file in the config.") from None
    except OSError as error:
        raise UsageError(f"The command file {file} could not be read: {error.strerror}.") from None
    return [line for line in lines if line.strip()]


def resolve_tpu_config(
    *,
    config_file: str | os.PathLike[str] | None = None,
    tpu_name: str | None = None,
    tpu_zone: str | None = None,
    tpu_project: str | None = None,
    tpu_block: str | None = None,
    use_alpha: bool = False,
    command: Sequence[str | Sequence[str]] | None = None,
    command_file: str | os.PathLike[str] | None = None,
    install_accelerate: bool = False,
    accelerate_version: str = "latest",
    install_prefect_accelerate: bool = False,
    prefect_accelerate_version: str = "latest",
) -> TpuConfigRequest:
    """Merge flags with the config file (any config, as Accelerate) into a TpuConfigRequest. Starts nothing.

    Example:
        >>> resolve_tpu_config(tpu_name="pod", tpu_zone="us-central1-a", command=["ls"]).debug_line()
        'Running gcloud compute tpus tpu-vm ssh pod --zone us-central1-a --command cd /usr/share; ls --worker all'

    Raises:
        UsageError: no commands, no pod name or zone, both --command and --command_file, a bad version.
        ConfigError: the config file is unreadable or invalid.
    """
    from prefect_accelerate.config.io import load_config_file

    commands = flatten_commands(command)
    if commands and command_file:
        raise UsageError("Give either --command or --command_file, not both (Accelerate would silently ignore the --command values).")
    loaded = load_config_file(config_file, required=config_file is not None)
    config = loaded.config if loaded is not None else None
    if config is not None:
        if not commands and not command_file:
            if getattr(config, "command_file", None):
                command_file = config.command_file
            elif getattr(config, "commands", None):
                commands = flatten_commands(config.commands)
    if command_file:
        commands = read_command_file(command_file)
    elif not commands:
        raise UsageError(
            "You must specify either a command file or a command to run on the pod: pass --command '...' (repeatable) or "
            "--command_file FILE, or set commands / command_file in the config file."
        )
    accelerate_requirement(accelerate_version)  # refuse a bad version before anything runs
    prefect_accelerate_requirement(prefect_accelerate_version)
    pod = resolve_pod(
        name=tpu_name, zone=tpu_zone, project=tpu_project, use_alpha=use_alpha, block=tpu_block,
        config_name=getattr(config, "tpu_name", None), config_zone=getattr(config, "tpu_zone", None), what="tpu-config",
    )
    return TpuConfigRequest(
        pod=pod, commands=tuple(commands), install_accelerate=install_accelerate, accelerate_version=accelerate_version,
        install_prefect_accelerate=install_prefect_accelerate, prefect_accelerate_version=prefect_accelerate_version,
    )


def run_tpu_config(
    request: TpuConfigRequest,
    *,
    on_line: Callable[[str, str], None] | None = None,
    timeout: float | None = None,
    run_dir: str | None = None,
    flow_run_id: str | None = None,
    task_run_id: str | None = None,
) -> TpuConfigResult:
    """Run the gcloud command under the launch supervisor (streamed, time-limited, stopped with the caller).

    Raises:
        LaunchError: gcloud failed (its exit code is the error's) or did not finish before `timeout`.
    """
    from prefect_accelerate.launchers.plan import LaunchPlan
    from prefect_accelerate.launchers.process import run_plan
    from prefect_accelerate.launchers.state import new_run_dir

    plan = LaunchPlan(launcher="tpu-config", argv=tuple(request.argv()), env=dict(GCLOUD_ENV), cwd=os.getcwd(),
                      run_dir=run_dir or str(new_run_dir("tpu-config")))
    result = run_plan(plan, on_line=on_line, timeout=timeout, flow_run_id=flow_run_id, task_run_id=task_run_id)
    outcome = TpuConfigResult(
        pod=request.pod.name, zone=request.pod.zone, command=list(plan.argv), exit_code=result.exit_code,
        duration_s=result.duration_s, log_path=result.log_path, tail=result.tail,
    )
    if result.timed_out:
        raise LaunchError(f"tpu-config on pod {request.pod.name} did not finish within {timeout} s and was stopped. Full log: {result.log_path}.",
                          exit_code=result.exit_code)
    if result.exit_code != 0:
        last = " | ".join(line.strip() for line in result.tail[-8:] if line.strip())
        raise LaunchError(
            f"gcloud exited with code {result.exit_code} while setting up pod {request.pod.name} (zone {request.pod.zone}); "
            f"nothing was reported as set up. {('Last lines: ' + last + '. ') if last else ''}Check the pod's name, zone "
            f"and project (`gcloud compute tpus tpu-vm list --zone {request.pod.zone}`) and your gcloud login. Full log: "
            f"{result.log_path}.",
            exit_code=result.exit_code,
        )
    return outcome
