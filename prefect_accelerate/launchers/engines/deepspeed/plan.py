"""DeepSpeed launches: Accelerate's `prepare_deepspeed_cmd_env` (reference §4.3.3) as a pure plan, with fixes.

One machine, and several machines with `deepspeed_multinode_launcher: standard`, run through torchrun
(engines/torchrun.py) with the DeepSpeed environment. Other multi-machine launchers run DeepSpeed's
own runner (`python -m deepspeed.launcher.runner`, what the `deepspeed` command runs), which starts the
job on every host through pdsh, an MPI, Slurm, or, with `nossh`, on this machine only as one node.

Differences from Accelerate 1.16.0 (docs/compatibility.md, pinned by tests/launchers/engines/deepspeed/test_deepspeed_parity.py):
- the NVMe offload paths are exported (Accelerate's DeepSpeed plugin reads them, its launcher never sets them);
- settings that Accelerate's DeepSpeed plugin refuses next to a DeepSpeed JSON file (mixed_precision,
  zero_stage, ... from the config file) are refused before launch, as are a missing or unreadable JSON file,
  one without `zero_optimization` and a precision that contradicts it;
- the variables for the other machines go to `.deepspeed_env` in this launch's run folder (DS_ENV_FILE
  points DeepSpeed there) instead of being appended, with the whole environment, to ./.deepspeed_env on
  every launch; the user's own ~/ and ./.deepspeed_env lines are carried into it; secrets never are;
- the MPI launchers get no `--num_gpus` (DeepSpeed's MPI runners refuse it, so Accelerate's command
  never starts) and filters are refused before launch for them;
- the hostfile and filters are checked before launch (a missing hostfile is an error instead of a silent
  single-machine run), and a layout that differs from num_processes/num_machines is a warning;
- a missing machine_rank counts as 0 (Accelerate raises TypeError); nossh without a main address and an
  unknown multi-node launcher are refused before launch;
- ACCELERATE_CONFIG_DS_FIELDS lists the config's DeepSpeed keys sorted, not in the file's order (the
  plugin only tests membership);
- the runner is started as `<python> -m deepspeed.launcher.runner` (the interpreter of this launch)
  rather than whichever `deepspeed` is first on PATH.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re

from prefect_accelerate.errors import ConfigError, DependencyError, LaunchError, UsageError
from prefect_accelerate.launchers import environment as blocks
from prefect_accelerate.launchers.host import HostProbe
from prefect_accelerate.launchers.engines.deepspeed.hostfile import read_hostfile, select_resources
from prefect_accelerate.launchers.plan import LaunchPlan
from prefect_accelerate.launchers.state import new_run_dir
from prefect_accelerate.launchers.engines.torchrun import plan_torchrun, resolve_port
from prefect_accelerate.secrets import is_secret_name

#: Accelerate's `nossh` needs DeepSpeed's --no_ssh, added in this version
NOSSH_MIN_VERSION = (0, 14, 5)
#: the file name DeepSpeed's runner looks for (in ~ and .) unless DS_ENV_FILE names another
DS_ENV_FILE_NAME = ".deepspeed_env"

#: launcher -> program DeepSpeed's runner checks for before it starts (None: nothing to check)
RUNNER_BACKENDS: dict[str, str | None] = {
    "pdsh": "pdsh", "openmpi": "ompi_info", "mpich": "mpirun", "impi": "mpirun", "mvapich": "mpiname",
    "slurm": "sinfo", "nossh": None,
}
#: launchers whose DeepSpeed runner refuses --num_gpus, --include and --exclude: mpirun gets the whole hostfile
MPI_LAUNCHERS = frozenset({"openmpi", "mpich", "impi", "mvapich"})
#: launchers that need the same slot count on every host
EQUAL_SLOTS_LAUNCHERS = frozenset({"mpich", "impi", "mvapich"})
LAUNCHER_CHOICES = ("pdsh", "standard", "openmpi", "mvapich", "mpich", "impi", "nossh", "slurm")

#: (option, variable, lower-cased) in Accelerate's order; the last two are ours (reference §13.4)
DEEPSPEED_VARIABLES: tuple[tuple[str, str, bool], ...] = (
    ("zero_stage", "ACCELERATE_DEEPSPEED_ZERO_STAGE", False),
    ("gradient_accumulation_steps", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", False),
    ("gradient_clipping", "ACCELERATE_GRADIENT_CLIPPING", True),
    ("offload_optimizer_device", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", True),
    ("offload_param_device", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", True),
    ("zero3_init_flag", "ACCELERATE_DEEPSPEED_ZERO3_INIT", True),
    ("zero3_save_16bit_model", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", True),
    ("deepspeed_config_file", "ACCELERATE_DEEPSPEED_CONFIG_FILE", False),
    ("offload_optimizer_nvme_path", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH", False),
    ("offload_param_nvme_path", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH", False),
)
#: config-file settings Accelerate's DeepSpeed plugin refuses at run time when a JSON file is used
JSON_OWNED_FIELDS = (
    "gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device", "offload_param_device",
    "offload_param_nvme_path", "offload_optimizer_nvme_path", "zero3_save_16bit_model", "mixed_precision",
)
#: characters Accelerate refuses in .deepspeed_env lines (DeepSpeed pastes them into a shell command)
_FORBIDDEN_IN_ENV_FILE = (";", "\n", "<", ">", " ")


def installed_deepspeed_version() -> tuple[int, ...] | None:
    """DeepSpeed's version from its metadata (no import: that takes seconds), None when absent."""
    from importlib import metadata

    try:
        text = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return None
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def launcher_kind(options) -> str:
    """`torchrun` (one machine, or `standard`), else the DeepSpeed runner's launcher name."""
    launcher = str(options.deepspeed_multinode_launcher or "pdsh").lower()
    if int(options.num_machines or 1) <= 1:
        return "torchrun"  # the multi-node launcher is not used on one machine (as in Accelerate)
    if launcher not in LAUNCHER_CHOICES:
        raise UsageError(
            f"Unknown deepspeed_multinode_launcher {options.deepspeed_multinode_launcher!r}. Choose one of "
            f"{', '.join(LAUNCHER_CHOICES)} (standard runs torchrun on every machine; nossh runs DeepSpeed's runner "
            "on every machine without ssh)."
        )
    return "torchrun" if launcher == "standard" else launcher


def _json_config(options, cwd: str) -> dict | None:
    """The DeepSpeed JSON (a path, or base64 JSON text as Accelerate also accepts), checked; None without one."""
    source = options.deepspeed_config_file
    if source is None:
        return None
    path = os.path.join(cwd, str(source))
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as handle:
                config = json.load(handle)
        except json.JSONDecodeError as error:
            raise ConfigError(
                f"The DeepSpeed config file {source} is not valid JSON (line {error.lineno}, column {error.colno}: "
                f"{error.msg}). Fix the file; DeepSpeed would stop on it inside every process."
            ) from None
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"The DeepSpeed config file {source} could not be read ({error}).") from None
    else:
        try:
            config = json.loads(base64.urlsafe_b64decode(str(source)).decode("utf-8"))
        except (binascii.Error, ValueError, UnicodeDecodeError):
            raise ConfigError(
                f"The DeepSpeed config file {source} does not exist (looked in {cwd}). Pass an existing JSON file to "
                "--deepspeed_config_file (a relative path is relative to the launch's working directory)."
            ) from None
    if not isinstance(config, dict):
        raise ConfigError(f"The DeepSpeed config file {source} must hold a JSON object, not {type(config).__name__}.")
    return config


def check_config_file_settings(options, cwd: str) -> None:
    """Refuse before launch what Accelerate's DeepSpeed plugin would refuse inside the script (§13.5)."""
    config = _json_config(options, cwd)
    if config is None:
        return
    where = options.config_path or "the config file"
    clashing = [name for name in options.deepspeed_config_fields if name.lower() in JSON_OWNED_FIELDS]
    if clashing:
        raise ConfigError(
            f"{where} sets {', '.join(clashing)} while the DeepSpeed JSON file {options.deepspeed_config_file} is "
            "used: with a JSON file those settings belong in the JSON (mixed precision in its fp16/bf16 sections, "
            "ZeRO settings under zero_optimization), and Accelerate's DeepSpeed plugin would stop with a ValueError "
            f"inside every process. Move them into the JSON file and remove them from {where}."
        )
    if "zero_optimization" not in config:
        raise ConfigError(
            f"The DeepSpeed config file {options.deepspeed_config_file} has no zero_optimization section, which "
            'Accelerate requires. Add one, e.g. "zero_optimization": {"stage": 2}.'
        )
    def enabled(name: str) -> bool:
        section = config.get(name)
        return isinstance(section, dict) and str(section.get("enabled", "false")).lower() == "true"

    if enabled("fp16") and enabled("bf16"):
        raise ConfigError(
            f"The DeepSpeed config file {options.deepspeed_config_file} enables both fp16 and bf16; DeepSpeed "
            'refuses that inside every process. Set "enabled": false in one of the two sections.'
        )
    precision = str(options.mixed_precision or "no").lower()
    if precision != "no":
        other = "bf16" if precision == "fp16" else "fp16"
        section = config.get(other)
        if isinstance(section, dict) and str(section.get("enabled", "false")).lower() == "true":
            raise ConfigError(
                f"mixed_precision is {precision} but the DeepSpeed config file {options.deepspeed_config_file} enables "
                f"{other}. Choose one: pass --mixed_precision {other} (or no), or disable {other} in the JSON."
            )


def deepspeed_env(options, host: HostProbe, cwd: str) -> tuple[dict[str, str], list[str]]:
    """The variables `accelerate launch` gives a DeepSpeed job (plus the NVMe paths), and warnings."""
    env: dict[str, str] = {}
    env |= blocks.debug_env(options)
    env |= blocks.visible_devices_env(options, host)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    env["PYTHONPATH"] = ":".join([*paths, os.path.abspath(cwd)])
    env |= blocks.mixed_precision_env(options)
    env |= blocks.fp8_env(options, host)
    env["ACCELERATE_CONFIG_DS_FIELDS"] = ",".join(options.deepspeed_config_fields).lower()
    env["ACCELERATE_USE_DEEPSPEED"] = "true"
    for name, variable, lower in DEEPSPEED_VARIABLES:
        value = getattr(options, name)
        if value is not None:
            env[variable] = str(value).lower() if lower else str(value)
    env |= blocks.cpu_affinity_env(options)
    if options.deepspeed_moe_layer_cls_names is not None:
        env["ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"] = str(options.deepspeed_moe_layer_cls_names)
    env |= blocks.parallelism_env(options)
    guard, warning = blocks.nccl_guard_env(host, {**os.environ, **env})
    env |= guard
    return env, [warning] if warning else []


def _read_user_env_file(path: str) -> list[tuple[str, str]]:
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    return [tuple(line.split("=", 1)) for line in lines if "=" in line]  # type: ignore[misc]


def env_file_content(env: dict[str, str], cwd: str) -> tuple[str, list[str], list[str]]:
    """`.deepspeed_env` for this launch: the user's ~/ and ./.deepspeed_env lines, then the launch's variables.

    Our DS_ENV_FILE replaces DeepSpeed's own lookup (~/ then ./, of $DS_ENV_FILE when the user set it), so
    the user's files are carried over as DeepSpeed would have read them, later lines winning. Returns
    (content, notes, warnings); values never appear in notes or warnings.
    """
    entries: dict[str, str] = {}
    notes: list[str] = []
    warnings: list[str] = []
    name = os.environ.get("DS_ENV_FILE") or DS_ENV_FILE_NAME  # the user's own choice of file, if any
    paths = dict.fromkeys(os.path.join(folder, name) for folder in (os.path.expanduser("~"), os.path.abspath(cwd)))
    for path in paths:
        found = _read_user_env_file(path) if os.path.isfile(path) else []
        if found:
            notes.append(f"{len(found)} line(s) of {path} are carried into this launch's {DS_ENV_FILE_NAME}.")
        entries.update((key.strip(), value.strip()) for key, value in found)
    entries.update((key, value) for key, value in env.items() if key != "DS_ENV_FILE")
    lines, skipped, secret = [], [], []
    for key, value in entries.items():
        if not key or not value:
            continue  # nothing to carry: unset and empty read the same on the other side
        if is_secret_name(key):
            secret.append(key)
        elif any(char in key + value for char in _FORBIDDEN_IN_ENV_FILE):
            skipped.append(key)
        else:
            lines.append(f"{key}={value}\n")
    if secret:
        warnings.append(
            f"Not forwarded to the other machines: {', '.join(sorted(secret))}. Secrets are never written to "
            f"{DS_ENV_FILE_NAME} (DeepSpeed would put them on the remote command lines); set them on each machine "
            "instead (its shell profile or a credentials file)."
        )
    if skipped:
        warnings.append(
            f"Not forwarded to the other machines: {', '.join(skipped)}; their values contain a space, ';', "
            "'<', '>' or a newline, which DeepSpeed cannot pass through its remote command."
        )
    return "".join(lines), notes, warnings


def _check_runner_backend(launcher: str, host: HostProbe) -> None:
    program = RUNNER_BACKENDS[launcher]
    if program is None or host.which(program):
        return
    raise LaunchError(
        f"deepspeed_multinode_launcher is {launcher}, and DeepSpeed's runner starts it only when `{program}` is on PATH, "
        f"which it is not on this machine. Install {launcher} here (the machine that launches), or choose another "
        "launcher: standard runs torchrun on every machine, nossh runs DeepSpeed on every machine without ssh."
    )


def runner_arguments(options, launcher: str, port: int, *, num_gpus: bool = True) -> list[str]:
    """The `deepspeed` arguments Accelerate builds, minus --num_gpus for the MPI launchers (and when `num_gpus` is False)."""
    args = ["--hostfile", str(options.deepspeed_hostfile)]
    if launcher == "nossh":
        args += ["--node_rank", str(int(options.machine_rank or 0)), "--no_ssh"]
    else:
        args += ["--no_local_rank", "--launcher", launcher]
    if options.deepspeed_exclusion_filter is not None:
        args += ["--exclude", str(options.deepspeed_exclusion_filter)]
    elif options.deepspeed_inclusion_filter is not None:
        args += ["--include", str(options.deepspeed_inclusion_filter)]
    elif launcher not in MPI_LAUNCHERS and num_gpus:
        args += ["--num_gpus", str(int(options.num_processes) // int(options.num_machines))]
    if options.main_process_ip:
        args += ["--master_addr", str(options.main_process_ip)]
    args += ["--master_port", str(port)]
    if options.module:
        args.append("--module")
    elif options.no_python:
        args.append("--no_python")
    return args


def _check_resources(options, launcher: str, cwd: str) -> tuple[list[str], list[str]]:
    """Validate hostfile and filters; predict what DeepSpeed will start. Returns (notes, warnings)."""
    if options.deepspeed_hostfile is None:
        raise ConfigError(
            f"num_machines is {options.num_machines} with the {launcher} launcher, which needs a DeepSpeed hostfile "
            "listing the machines (`HOST slots=N` per line). Pass --deepspeed_hostfile (or set deepspeed_hostfile in "
            "the config); without one DeepSpeed runs on this machine alone."
        )
    path = os.path.join(cwd, str(options.deepspeed_hostfile))
    hostfile = read_hostfile(path, shown_as=str(options.deepspeed_hostfile))
    include, exclude = options.deepspeed_inclusion_filter, options.deepspeed_exclusion_filter
    warnings: list[str] = []
    if include is not None and exclude is not None:
        warnings.append(
            f"Both an inclusion ({include}) and an exclusion filter ({exclude}) are set; as in Accelerate only the "
            "exclusion filter is used. Remove one to silence this warning."
        )
        include = None
    if launcher in MPI_LAUNCHERS:
        if include is not None or exclude is not None:
            raise ConfigError(
                f"The {launcher} launcher cannot use a DeepSpeed inclusion or exclusion filter: mpirun gets the whole "
                f"hostfile {options.deepspeed_hostfile}. Remove the filter and list only the hosts to use in the hostfile."
            )
        counts = {host.slots for host in hostfile.hosts}
        if launcher in EQUAL_SLOTS_LAUNCHERS and len(counts) > 1:
            raise ConfigError(
                f"The {launcher} launcher needs the same slots on every host, but {options.deepspeed_hostfile} has "
                f"{hostfile.describe()}. Give every host the same slots=N."
            )
        active = {host.name: list(range(host.slots)) for host in hostfile.hosts}
    else:
        per_node = int(options.num_processes) // int(options.num_machines)
        active = select_resources(hostfile, include=include, exclude=exclude, per_node=per_node)
    world = sum(len(slots) for slots in active.values())
    notes = [f"DeepSpeed will start {world} process(es) on {len(active)} host(s): "
             + ", ".join(f"{name} ({len(slots)})" for name, slots in active.items()) + "."]
    if launcher == "nossh" and not 0 <= int(options.machine_rank or 0) < len(active):
        raise ConfigError(
            f"machine_rank is {options.machine_rank}, but the hostfile {options.deepspeed_hostfile} (after filters) has "
            f"{len(active)} host(s), so node ranks go from 0 to {len(active) - 1}. Pass the right --machine_rank on "
            "each machine."
        )
    if world != int(options.num_processes) or len(active) != int(options.num_machines):
        warnings.append(
            f"num_processes is {options.num_processes} on {options.num_machines} machine(s), but DeepSpeed takes the "
            f"layout from the hostfile and will start {world} process(es) on {len(active)} host(s). Make the hostfile "
            "(or filters) and --num_processes/--num_machines agree, or the world size is not what you asked for."
        )
    if launcher == "slurm" and (include or exclude):
        uneven = len({len(slots) for slots in active.values()}) > 1
        if uneven or any(slots != list(range(len(slots))) for slots in active.values()):
            raise ConfigError(
                "The slurm launcher places processes by count, so a filter must leave the first N slots of every "
                "host, the same N everywhere; this one leaves "
                + ", ".join(f"{name} slots {slots}" for name, slots in active.items()) + ". Filter whole hosts instead."
            )
    return notes, warnings


def prepare(options, host: HostProbe, cwd: str) -> tuple[tuple[int, ...], dict[str, str], list[str]]:
    """What every DeepSpeed launch checks and sets first, whoever runs it (this engine, or the Slurm engine for
    DeepSpeed's own slurm launcher): DeepSpeed's version, the flags, the config file's settings, the environment."""
    version = installed_deepspeed_version()
    if version is None:
        raise DependencyError.missing("deepspeed", "deepspeed", "A DeepSpeed launch (--use_deepspeed)")
    if options.module and options.no_python:
        raise UsageError("--module and --no_python cannot be used together.")
    check_config_file_settings(options, cwd)
    env, warnings = deepspeed_env(options, host, cwd)
    return version, env, warnings


def plan(options, host: HostProbe, *, cwd: str, run_dir: str | None) -> LaunchPlan:
    """The plan for a DeepSpeed launch. Starts nothing; reads only the hostfile and DeepSpeed JSON it names.

    Raises:
        DependencyError: DeepSpeed is not installed. UsageError: contradictory flags, an unknown launcher.
        ConfigError: a bad hostfile, filter or DeepSpeed JSON, or settings the DeepSpeed plugin would refuse.
        LaunchError: the launcher's program is missing, or the port is busy.
    """
    version, env, warnings = prepare(options, host, cwd)
    kind = launcher_kind(options)
    if kind == "torchrun":
        base = plan_torchrun(options, host, cwd, run_dir, cpu=False, extra_env=env, launcher="torchrun-deepspeed")
        return base.model_copy(update={"warnings": (*warnings, *base.warnings)})

    if kind == "nossh" and version < NOSSH_MIN_VERSION:
        raise DependencyError(
            f"The nossh launcher needs DeepSpeed 0.14.5 or newer (its --no_ssh flag); this environment has "
            f"{'.'.join(map(str, version))}. Upgrade DeepSpeed, or use the standard launcher."
        )
    if kind == "nossh" and not options.main_process_ip:
        raise UsageError(
            "The nossh launcher needs --main_process_ip (the address of the machine of rank 0): without it DeepSpeed "
            "asks the first host over ssh, which nossh is meant to avoid."
        )
    _check_runner_backend(kind, host)
    notes, more_warnings = _check_resources(options, kind, cwd)
    port, port_notes = resolve_port(options, host)
    argv = [host.python(), "-m", "deepspeed.launcher.runner", *runner_arguments(options, kind, port),
            options.training_script, *options.training_script_args]
    env |= blocks.unbuffered_env()
    files: dict[str, str] = {}
    if kind != "nossh":  # with --no_ssh the runner starts this node's processes itself and reads no env file
        run_dir = run_dir or str(new_run_dir())
        content, file_notes, file_warnings = env_file_content(env, cwd)
        env_file = os.path.abspath(os.path.join(run_dir, DS_ENV_FILE_NAME))
        files[env_file] = content
        env["DS_ENV_FILE"] = env_file
        notes += [f"DeepSpeed forwards the variables in {env_file} (DS_ENV_FILE) to the other machines; nothing is "
                  f"written to {os.path.join(os.path.abspath(cwd), DS_ENV_FILE_NAME)}.", *file_notes]
        more_warnings += file_warnings
    if options.defaults_warning:
        warnings.insert(0, options.defaults_warning)
    return LaunchPlan(
        launcher=f"deepspeed-{kind}",
        argv=tuple(argv),
        env=env,
        cwd=cwd,
        num_processes=int(options.num_processes),
        num_machines=int(options.num_machines),
        machine_rank=int(options.machine_rank or 0),
        run_dir=run_dir,
        warnings=(*warnings, *more_warnings),
        notes=(*options.notes, *port_notes, *notes),
        files=files,
    )
