"""Names a Prefect user can tell pipelines apart by: flow run names and artifact keys.

A pipeline is its config file, script, model and launch flags. Two different pipelines get different
names and keys; the same pipeline gets the same ones every time, so an artifact key's history in
Prefect is that pipeline's history (and not whichever pipeline ran last). No Prefect import here.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePath

from prefect_accelerate.pipeline.keys import digest
from prefect_accelerate.pipeline.models import PipelineRequest

#: what a run name says when no config file was read (flags only, e.g. `--cpu` without a default config)
NO_CONFIG = "no-config-file"


def _slug(text: str) -> str:
    return re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9]+", "-", text.lower())).strip("-")


def config_name(request: PipelineRequest) -> str:
    """The config file this pipeline reads: the file named, else the default config when one exists."""
    if request.config_file:
        return Path(request.config_file).name
    from prefect_accelerate.config.paths import find_default_config

    found = find_default_config()
    return found.path.name if found else NO_CONFIG


def _model_name(request: PipelineRequest) -> str | None:
    return PurePath(request.model.rstrip("/")).name or request.model if request.model else None


def identity(request: PipelineRequest) -> str:
    """A short hash of what makes two pipelines different (not of file contents: editing the config keeps
    the pipeline, and its history, the same)."""
    config = str(Path(request.config_file).expanduser().resolve()) if request.config_file else "default:" + config_name(request)
    return digest({
        "config": config, "script": str(Path(request.script).expanduser()), "script_args": request.script_args,
        "model": request.model, "memory": request.memory.model_dump(mode="json", exclude={"measure"}),  # measuring the gate is the same pipeline
        "flags": request.launch_flags,
    })[:6]


def run_name(prefix: str, request: PipelineRequest, launcher: str | None = None) -> str:
    """`launch-training-torchrun-cpu.yaml-train-tiny-gpt2-2p`: launcher, config file, script, model, processes."""
    parts = [prefix]
    if launcher:
        parts.append(launcher)
    parts += [config_name(request), Path(request.script).stem]
    model = _model_name(request)
    if model:
        parts.append(model)
    processes = request.launch_flags.get("num_processes")
    if processes:
        parts.append(f"{processes}p")
    return "-".join(parts)


def artifact_key(kind: str, request: PipelineRequest) -> str:
    """`memory-fit-cpu-yaml-train-tiny-gpt2-3f9a1c`: the artifact's kind, then the pipeline (readable, then its
    identity hash). Prefect keys allow lowercase letters, digits and dashes."""
    readable = [config_name(request).rsplit(".", 1)[0], Path(request.script).stem, _model_name(request) or ""]
    name = _slug("-".join(part for part in readable if part))[:48].strip("-")
    return f"{kind}-{name}-{identity(request)}" if name else f"{kind}-{identity(request)}"
