"""LaunchOptions: the config file, defaults and explicit flags merged exactly as `accelerate launch` does.

The merge follows Accelerate 1.16's `_validate_launch_command` (reference §4.2) step by step, with the
fixes listed in docs/compatibility.md:

- config values for rdzv_backend, same_network, enable_cpu_affinity, downcast_bf16 and tpu_use_sudo
  are applied when the flag was not given (Accelerate never applies them);
- `--use_parallelism_config` is checked after the config is merged, and against FSDP version 2 by
  value (Accelerate compares the string "1" with the int 1);
- `--num_processes` below 1 is refused;
- problems are UsageError/ConfigError messages, not assertions or tracebacks.

The result is frozen: planning never changes the options it was given.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, SecretStr, create_model, field_serializer

from prefect_accelerate.config.enums import MULTI_DEVICE_TYPES, DistributedType
from prefect_accelerate.config.io import LoadedConfig, load_config_path
from prefect_accelerate.config.model import (
    MAX_MACHINES, MAX_PROCESSES, MAX_PROCESSES_PER_MACHINE, SECTION_MODELS, ClusterConfig, SageMakerConfig, address_problem, as_bool,
)
from prefect_accelerate.config.paths import find_default_config
from prefect_accelerate.errors import ConfigError, UsageError

#: seconds a Prefect worker waits after SIGTERM before it kills a cancelled flow-run process (prefect-and-peers §2.8)
PREFECT_KILL_SECONDS = 30
from prefect_accelerate.launchers.flags import HONOURED_CONFIG_SCALARS, LAUNCH_DEFAULTS, SECRET_DESTS
from prefect_accelerate.launchers.host import HostProbe, local_host

DEFAULTS_WARNING_HEAD = "The following values were not passed to `prefect-accelerate launch` and had defaults used instead:"
DEFAULTS_WARNING_TAIL = (
    "To avoid this warning pass in values for each of the problematic parameters, or write a config file with "
    "`prefect-accelerate config`."
)

# the most processes one launch may start in all and on one machine, and the most machines: far above any real
# cluster, low enough that a typo (99999999999) is an error. They live in config/model.py, the one rule set.

#: config scalars Accelerate copies but that are not flags
_CONFIG_ONLY_SCALARS = ("use_cpu", "tpu_name", "tpu_zone", "command_file", "commands", "tpu_vm", "tpu_env")
#: config section keys (launch names) that are not flags
_SECTION_ONLY = sorted(
    {name for model in SECTION_MODELS.values() for name in model.model_fields} - set(LAUNCH_DEFAULTS)
)


class _OptionsBase(BaseModel):
    """Fields that are not `accelerate launch` flags: the script, provenance, and our own settings."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    training_script: str
    training_script_args: tuple[str, ...] = ()
    #: destinations of the flags the user passed explicitly
    given: frozenset[str] = frozenset()
    config_path: str | None = None
    config_source: str | None = None
    compute_environment: str = "LOCAL_MACHINE"
    distributed_type: str | None = None
    sagemaker: SageMakerConfig | None = None
    mixed_precision_from_config: bool = False
    #: keys of the config's deepspeed_config, plus mixed_precision when it came from the config
    deepspeed_config_fields: tuple[str, ...] = ()
    defaults_warning: str | None = None
    notes: tuple[str, ...] = ()
    # prefect-accelerate's own settings
    timeout: float | None = None
    grace_period: float = 20.0
    run_dir: str | None = None

    def flag(self, name: str) -> Any:
        return getattr(self, name)

    @field_serializer("training_script_args", when_used="json")
    def _args_without_secrets(self, args: tuple[str, ...]) -> list[str]:
        # stored as a flow parameter: a token pasted on the command line (`--tok $HF_TOKEN`) must not be
        from prefect_accelerate.secrets import redact_argv

        return list(redact_argv(args))

    def is_given(self, name: str) -> bool:
        return name in self.given

    @property
    def script_display(self) -> str:
        return " ".join([self.training_script, *self.training_script_args])

    def with_changes(self, **changes: Any) -> LaunchOptions:
        """A copy with some values replaced (the original is never changed)."""
        return self.model_copy(update=changes)


_fields: dict[str, Any] = {name: (Any, default) for name, default in LAUNCH_DEFAULTS.items()}
_fields.update({name: (Any, None) for name in (*_CONFIG_ONLY_SCALARS, *_SECTION_ONLY) if name not in _fields})
_fields["use_cpu"] = (bool, False)

LaunchOptions = create_model("LaunchOptions", __base__=_OptionsBase, **_fields)  # type: ignore[call-overload]
LaunchOptions.__doc__ = (
    "Everything a launch needs, after merging config file, defaults and flags. One field per "
    "`accelerate launch` flag (same names), plus the script, provenance and our own settings."
)
OPTION_FIELDS: frozenset[str] = frozenset(LaunchOptions.model_fields)


def _int_from_env(environ: Mapping[str, str], names: Iterable[str], default: int) -> int:
    for name in names:
        try:
            value = int(environ.get(name, -1))
        except ValueError:
            continue
        if value >= 0:
            return value
    return default


def _load(config_file: str | None, cpu: bool) -> LoadedConfig | None:
    if config_file is not None:
        return load_config_path(config_file)
    if cpu:
        return None  # Accelerate ignores the default config under --cpu
    location = find_default_config()
    return load_config_path(location.path, source=location.source) if location else None


def resolve_launch_options(
    values: Mapping[str, Any],
    given: Iterable[str],
    *,
    environ: Mapping[str, str] | None = None,
    host: HostProbe | None = None,
    loaded: LoadedConfig | None = None,
) -> LaunchOptions:
    """Merge flags with the config file and defaults.

    Args:
        values: flag destinations and values as parsed (missing ones take their defaults), plus
            `training_script`, `training_script_args`, and optionally our own `timeout`, `grace_period`, `run_dir`.
        given: destinations the user passed explicitly (they win over the config, even at their default value).
        environ: the environment to read OMP_NUM_THREADS and MPI local sizes from (os.environ by default).
        host: the machine to launch on (device count, bf16 support).
        loaded: an already loaded config; otherwise it is loaded from `config_file` or the default path.

    Raises:
        UsageError: contradictory flags. ConfigError: an unreadable config, or one without num_processes.
    """
    env = os.environ if environ is None else environ
    machine = host or local_host()
    a: dict[str, Any] = dict(LAUNCH_DEFAULTS)
    a.update({k: v for k, v in values.items() if v is not None or k in given})
    given_set = frozenset(given) | {"training_script", "training_script_args"}
    if not a.get("training_script"):
        raise UsageError("No training script was given. Usage: prefect-accelerate launch [flags] script.py [script args]")
    a["training_script_args"] = tuple(a.get("training_script_args") or ())
    if a["training_script_args"][:1] == ("--",):
        a["training_script_args"] = a["training_script_args"][1:]
    for name in SECRET_DESTS:  # kept out of reprs, logs, flow parameters and results
        if a.get(name) is not None and not isinstance(a[name], SecretStr):
            a[name] = SecretStr(str(a[name]))

    paradigms = [name for name in ("multi_gpu", "cpu", "tpu", "use_deepspeed", "use_fsdp") if a.get(name)]
    if len(paradigms) > 1:
        raise UsageError(
            f"You can only use one of --cpu, --multi_gpu, --tpu, --use_deepspeed, --use_fsdp at a time; got "
            f"{', '.join('--' + p for p in paradigms)}. Keep the one you mean."
        )
    if a.get("num_processes") is not None and a["num_processes"] < 1:
        raise UsageError(f"--num_processes {a['num_processes']} is not a process count; pass 1 or more.")
    if a["multi_gpu"] and a.get("num_processes") is not None and a["num_processes"] < 2:
        raise UsageError("--multi_gpu needs at least 2 processes; pass --num_processes 2 or more, or drop --multi_gpu.")
    if a.get("no_python") and a.get("module"):
        raise UsageError("--module and --no_python cannot be used together: -m runs a Python module, --no_python an executable.")

    warned: list[str] = []
    notes: list[str] = []
    mp_from_config = False
    if loaded is None:
        loaded = _load(a.get("config_file"), bool(a["cpu"]))
    config = loaded.config if loaded else None
    extra: dict[str, Any] = {}
    if loaded is not None:
        extra.update(config_path=str(loaded.path), config_source=loaded.location.source)
        if loaded.location.source != "passed":
            notes.append(loaded.location.describe())
        for change in loaded.migration.legacy_changes:
            notes.append(f"The config file uses an older format (migrated in memory: {change}); run `prefect-accelerate config update` to save it.")
    elif a["cpu"] and a.get("config_file") is None and find_default_config() is not None:
        notes.append("The default config file was not read because --cpu was given (as in Accelerate).")

    if config is not None:
        extra["compute_environment"] = config.compute_environment.value
        extra["distributed_type"] = config.distributed_type.value
        if not any(a.get(n) for n in ("multi_gpu", "tpu", "tpu_use_cluster", "use_deepspeed", "use_fsdp", "use_megatron_lm")):
            kind = config.distributed_type
            a["use_deepspeed"] = kind == DistributedType.DEEPSPEED
            a["multi_gpu"] = kind in MULTI_DEVICE_TYPES
            a["tpu"] = kind == DistributedType.XLA
            a["use_fsdp"] = kind == DistributedType.FSDP
            a["use_megatron_lm"] = kind == DistributedType.MEGATRON_LM
            a["tpu_use_cluster"] = as_bool(getattr(config, "tpu_use_cluster", False)) if a["tpu"] else False
            a["use_parallelism_config"] = isinstance(config, ClusterConfig) and bool(config.parallelism_config.model_fields_set)
        if a.get("gpu_ids") is None:
            a["gpu_ids"] = config.gpu_ids if config.gpu_ids is not None else "all"
        if a["multi_gpu"] and a.get("num_machines") is None:
            a["num_machines"] = config.num_machines
        ids = str(a["gpu_ids"])
        if ids != "all" and len(ids.split(",")) < 2 and a["multi_gpu"] and (a.get("num_machines") or 1) <= 1:
            raise UsageError(
                f"gpu_ids is {ids!r}, fewer than two devices, but this is a multi-device launch on one machine. "
                "List at least two ids (--gpu_ids 0,1) or use --gpu_ids all."
            )
        if isinstance(config, ClusterConfig):
            for section_name in SECTION_MODELS:
                section = getattr(config, section_name)
                for key, value in section.launch_items().items():
                    if key not in given_set:
                        a[key] = value
            for name in type(config).model_fields:
                if name in SECTION_MODELS or name in ("compute_environment", "mixed_precision", "distributed_type"):
                    continue
                value = getattr(config, name)
                if name in HONOURED_CONFIG_SCALARS:
                    if name not in given_set:
                        a[name] = as_bool(value) if isinstance(LAUNCH_DEFAULTS.get(name), bool) else value
                elif a.get(name) is None:
                    a[name] = value
            a["use_cpu"] = as_bool(config.use_cpu)
        else:
            extra["sagemaker"] = config
            a["use_cpu"] = as_bool(config.use_cpu)
            for name in ("num_machines", "gpu_ids"):
                if a.get(name) is None:
                    a[name] = getattr(config, name)
        if not a.get("debug"):
            a["debug"] = as_bool(config.debug)
        if not a.get("mixed_precision"):
            if config.mixed_precision is None:
                a["mixed_precision"] = "no"
            else:
                a["mixed_precision"] = config.mixed_precision.value
                mp_from_config = True
        elif a["mixed_precision"] == "bf16" and not machine.bf16_available() and not a["tpu"]:
            raise UsageError(
                "--mixed_precision bf16 needs a device that supports bfloat16, and this machine's has none. "
                "Use fp16 or no, or run on hardware with bf16 support."
            )
        if a.get("dynamo_backend") is None:
            a["dynamo_backend"] = "no"
        if isinstance(config, ClusterConfig) and a.get("num_processes") in (None, -1):
            raise ConfigError(
                f"The config file {loaded.path} does not say how many processes to start (num_processes is missing "
                f"or -1). Pass --num_processes N, or add `num_processes: N` to the file."
            )
        if isinstance(config, ClusterConfig):
            fields = list(config.deepspeed_config.launch_items())
            if mp_from_config:
                fields.append("mixed_precision")
            extra["deepspeed_config_fields"] = tuple(fields)
    else:
        device_count = 0 if a["cpu"] else machine.accelerator_count()
        if machine.accelerator_kind() == "mps":
            device_count = 0
        if a.get("num_processes") is None:
            a["num_processes"] = max(device_count, 1)
            warned.append(f"\t`--num_processes` was set to a value of `{a['num_processes']}`")
        if a.get("debug") is None:
            a["debug"] = False
        if not a["multi_gpu"] and a["num_processes"] > 1 and device_count > 1:
            warned.append(
                "\t\tMore than one GPU was found, enabling multi-GPU training.\n"
                "\t\tIf this was unintended please pass in `--num_processes=1`."
            )
            a["multi_gpu"] = True
        if a.get("num_machines") is None:
            warned.append("\t`--num_machines` was set to a value of `1`")
            a["num_machines"] = 1
        if a.get("mixed_precision") is None:
            warned.append("\t`--mixed_precision` was set to a value of `'no'`")
            a["mixed_precision"] = "no"
        a["use_cpu"] = bool(a["cpu"])
        if a.get("dynamo_backend") is None:
            warned.append("\t`--dynamo_backend` was set to a value of `'no'`")
            a["dynamo_backend"] = "no"

    if a.get("use_parallelism_config") and not (a.get("use_fsdp") and str(a.get("fsdp_version")).strip() == "2"):
        raise UsageError(
            "--use_parallelism_config (or a parallelism_config section) needs FSDP version 2: pass --use_fsdp "
            "--fsdp_version 2, or remove the parallelism settings."
        )
    if a.get("num_processes") is not None and a["num_processes"] < 1:
        raise UsageError(f"num_processes is {a['num_processes']}; pass --num_processes 1 or more.")
    check_ranges(a, given_set)

    if config is None or not isinstance(config, SageMakerConfig):
        if a.get("num_cpu_threads_per_process") is None:
            a["num_cpu_threads_per_process"] = _int_from_env(env, ["OMP_NUM_THREADS"], 1)
            if a["use_cpu"] and a["num_processes"] >= 1 and _int_from_env(env, ["OMP_NUM_THREADS"], 0) == 0:
                local_size = _int_from_env(
                    env,
                    ["MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE"],
                    max(int(a["num_processes"] / a["num_machines"]), 1),
                )
                threads = int(machine.physical_cores() / local_size)
                if threads > 1:
                    a["num_cpu_threads_per_process"] = threads
                    warned.append(
                        f"\t`--num_cpu_threads_per_process` was set to `{threads}` to improve out-of-box performance when training on CPUs"
                    )

    grace = a.get("grace_period")
    if grace is not None:
        if not math.isfinite(float(grace)) or float(grace) <= 0:
            raise UsageError(f"--grace_period is {grace}: it must be a number of seconds above 0 (default 20).")
        if float(grace) >= PREFECT_KILL_SECONDS:
            notes.append(
                f"--grace_period {grace:g} s is not below Prefect's {PREFECT_KILL_SECONDS} s: a worker cancelling this flow run "
                "kills the flow-run process before the grace ends, so the launcher's own SIGKILL may not come; the "
                "package's on_cancellation hook still ends the recorded processes. Use less than 30 s under Prefect."
            )
    if warned:
        extra["defaults_warning"] = "\n".join([DEFAULTS_WARNING_HEAD, *warned, DEFAULTS_WARNING_TAIL])
    extra.update(given=given_set, mixed_precision_from_config=mp_from_config, notes=tuple(notes))
    fields = {k: v for k, v in a.items() if k in OPTION_FIELDS}
    return LaunchOptions(**fields, **extra)


def _name(dest: str, given: frozenset[str]) -> str:
    """How the user set a value: the flag when they passed it, else the config field."""
    return f"--{dest}" if dest in given else f"`{dest}` (from the config file or the default)"


def check_ranges(a: Mapping[str, Any], given: frozenset[str]) -> None:
    """Refuse values no launch can use, naming the flag (or the config field) and the range.

    One place for both sources: flags were parsed by argparse, config values were validated by the config
    model for type, and here both are held to what a launch can do.
    """
    def bad(dest: str, why: str) -> UsageError:
        return UsageError(f"{_name(dest, given)} is {a.get(dest)!r}: {why}. Fix the value and run the command again.")

    def whole(dest: str) -> int | None:
        value = a.get(dest)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            try:
                value = int(str(value))
            except ValueError:
                raise bad(dest, "it must be a whole number") from None
        return value

    machines = whole("num_machines")
    if machines is not None and not 1 <= machines <= MAX_MACHINES:
        raise bad("num_machines", f"it must be between 1 and {MAX_MACHINES}")
    processes = whole("num_processes")
    if processes is not None:
        if processes > MAX_PROCESSES:
            raise bad("num_processes", f"a launch starts at most {MAX_PROCESSES:,} processes in all")
        per_machine = processes // max(machines or 1, 1)
        if per_machine > MAX_PROCESSES_PER_MACHINE:
            raise bad("num_processes", f"that is {per_machine:,} processes on one machine; at most {MAX_PROCESSES_PER_MACHINE} are started per machine")
    rank = whole("machine_rank")
    if rank is not None and not 0 <= rank < max(machines or 1, 1):
        raise bad("machine_rank", f"machine ranks go from 0 to num_machines - 1 ({max(machines or 1, 1) - 1})")
    address = a.get("main_process_ip")
    if address is not None:
        problem = address_problem(str(address))
        if problem:
            raise bad("main_process_ip", problem)
    port = whole("main_process_port")
    if port is not None and not 0 <= port <= 65535:
        raise bad("main_process_port", "a port is between 1 and 65535 (or 0 to pick a free one)")
    stage = whole("zero_stage")
    if stage is not None and not 0 <= stage <= 3:
        raise bad("zero_stage", "DeepSpeed's ZeRO stages are 0, 1, 2 and 3")
    threads = whole("num_cpu_threads_per_process")
    if threads is not None and threads < 1:
        raise bad("num_cpu_threads_per_process", "it must be 1 or more")
    restarts = whole("max_restarts")
    if restarts is not None and restarts < 0:
        raise bad("max_restarts", "it must be 0 or more")
    ids = a.get("gpu_ids")
    if ids is not None and str(ids).strip().lower() != "all":
        parts = [part.strip() for part in str(ids).strip().rstrip(",").split(",")]
        if not parts or not all(part.isdigit() for part in parts):
            raise bad("gpu_ids", "it must be `all` or a comma-separated list of device indices such as 0,1")
    for dest in ("timeout", "monitor_interval"):
        value = a.get(dest)
        if value is None:
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise bad(dest, "it must be a number of seconds") from None
        if not math.isfinite(number) or number <= 0:
            raise bad(dest, "it must be a number of seconds above 0")


def options_from_namespace(
    namespace: argparse.Namespace,
    *,
    environ: Mapping[str, str] | None = None,
    host: HostProbe | None = None,
) -> LaunchOptions:
    """LaunchOptions from a namespace parsed by the `launch` parser (its `nondefault` set marks given flags)."""
    values = {k: v for k, v in vars(namespace).items() if k in OPTION_FIELDS or k == "config_file"}
    return resolve_launch_options(values, getattr(namespace, "nondefault", set()), environ=environ, host=host)


def build_launch_options(
    training_script: str,
    script_args: Sequence[str] = (),
    *,
    config_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    host: HostProbe | None = None,
    **flags: Any,
) -> LaunchOptions:
    """LaunchOptions from Python: every keyword is a launch flag the caller sets explicitly.

    Example:
        >>> options = build_launch_options("train.py", ["--lr", "3e-4"], num_processes=2, cpu=True)
    """
    unknown = sorted(set(flags) - OPTION_FIELDS)
    if unknown:
        from prefect_accelerate.errors import did_you_mean

        raise UsageError(
            f"Unknown launch option {unknown[0]!r}.{did_you_mean(unknown[0], OPTION_FIELDS)} Launch options are the "
            "`accelerate launch` flag names without dashes, e.g. num_processes=2."
        )
    values = dict(flags)
    values["training_script"] = str(training_script)
    values["training_script_args"] = tuple(script_args)
    if config_file is not None:
        values["config_file"] = str(config_file)
    own = {"timeout", "grace_period", "run_dir"}
    given = {k for k in flags if k not in own} | ({"config_file"} if config_file is not None else set())
    return resolve_launch_options(values, given, environ=environ, host=host)
