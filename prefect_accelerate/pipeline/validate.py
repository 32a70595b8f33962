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


def validate_one(config_file: str, validation: ValidationRequest) -> ConfigValidation:
    request = request_for(config_file, validation)
    report = run_preflight_direct(request, skip=frozenset({"env"}))  # the machine is probed once per validation run
    return ConfigValidation(config_file=config_file, ok=report.ok, failed_step=report.failed_step, message=report.message, steps=report.steps)
