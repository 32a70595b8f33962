"""Validate many config files (the scheduled validation run), without Prefect: expansion and one config's check."""

from __future__ import annotations

import glob
import os
from pathlib import Path

from prefect_accelerate.errors import UsageError
from prefect_accelerate.pipeline.direct import run_preflight_direct
from prefect_accelerate.pipeline.keys import digest
from prefect_accelerate.pipeline.models import ConfigValidation, PipelineRequest, ValidationRequest

CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def expand_configs(patterns: list[str]) -> list[str]:
    """Files, folders (their *.yaml / *.yml / *.json) and glob patterns, as sorted unique paths."""
    found: list[str] = []
    for pattern in patterns:
        path = Path(pattern).expanduser()
        if path.is_dir():
            found += [str(p) for p in sorted(path.iterdir()) if p.suffix in CONFIG_SUFFIXES and p.is_file()]
        elif path.is_file():
            found.append(str(path))
        else:
            matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
            if not matches:
                raise UsageError(f"No config files match {pattern!r}. Pass files, folders holding .yaml/.json configs, or glob patterns.")
            found += [m for m in matches if Path(m).is_file()]
    unique = list(dict.fromkeys(found))
    if not unique:
        raise UsageError(f"No config files were found in {', '.join(patterns)}.")
    return unique


def request_for(config_file: str, validation: ValidationRequest) -> PipelineRequest:
    from prefect_accelerate.selftest import SCRIPT

    return PipelineRequest(
        script=validation.script or str(SCRIPT), config_file=config_file, launch_flags=dict(validation.launch_flags),
        model=validation.model, memory=validation.memory, run_install_test=validation.run_install_test, force=list(validation.force),
    )


def validation_key(request: PipelineRequest) -> str:
    """One key for a config's whole preflight: the keys of all its enabled steps (env excluded: checked once)."""
    from prefect_accelerate.pipeline.graph import build_graph

    graph = build_graph(request, with_status=False)
    keys = {s.name: (s.key or s.inputs) for s in graph.steps if s.enabled and s.name not in ("env", "launch")}
    return "pa-validate-" + digest({"steps": keys, "error": graph.error})


def validate_one(config_file: str, validation: ValidationRequest, host=None) -> ConfigValidation:  # noqa: ANN001 - a HostProbe
    request = request_for(config_file, validation)
    report = run_preflight_direct(request, skip=frozenset({"env"}))  # the machine is probed once per validation run
    message = report.message
    note = config_note(config_file, ok=report.ok, failed_step=report.failed_step, host=host)
    if note:
        message = f"{message} {note}"
    return ConfigValidation(config_file=config_file, ok=report.ok, failed_step=report.failed_step, message=message, steps=report.steps)


#: distributed types whose launch is meant for GPUs (or other accelerators)
_DEVICE_TYPES = frozenset({"MULTI_GPU", "FSDP", "DEEPSPEED", "MEGATRON_LM", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_HPU"})


def config_note(config_file: str, *, ok: bool, failed_step: str | None, host=None) -> str:  # noqa: ANN001 - a HostProbe
    """What a pass or a failure of this config means on this machine: the cause and fix of a known failure,
    or that a device config passed on CPU only. Empty when there is nothing to add."""
    from prefect_accelerate.config.io import load_config_path
    from prefect_accelerate.config.model import as_bool
    from prefect_accelerate.errors import PrefectAccelerateError
    from prefect_accelerate.launchers.host import local_host

    try:
        config = load_config_path(config_file).config
    except PrefectAccelerateError:
        return ""  # the config step already said what is wrong
    kind = config.distributed_type.value
    use_cpu = as_bool(getattr(config, "use_cpu", False))
    if not ok and failed_step == "install-test" and kind == "DEEPSPEED" and use_cpu:
        return (
            "Cause: use_cpu: true turns DeepSpeed off inside Accelerate (its DeepSpeed set-up runs only without "
            "use_cpu), so the processes never formed one group and each counted only itself. Fix: set use_cpu: false "
            "(DeepSpeed uses its CPU accelerator on a machine without GPUs), or use distributed_type: MULTI_CPU for "
            "a plain CPU run."
        )
    if ok and kind in _DEVICE_TYPES and not use_cpu and (host or local_host()).accelerator_kind() in (None, "mps"):
        return (
            f"Checked on CPU only: this machine has no GPU, so the {kind} self-test ran its processes with gloo on CPU; "
            "the GPU path (NCCL, device placement, memory) was not exercised. Run validate on a GPU machine for that."
        )
    return ""
