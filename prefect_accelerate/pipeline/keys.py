"""Content-hash cache keys for preflight steps (Nextflow's `-resume`, Snakemake's rerun triggers).

A step's key is the hash of exactly the inputs it reads: file contents (config file, DeepSpeed JSON,
model config), the settings derived from them that the step uses, the script's path (its content is
read only by the launch, which is never cached), the environment it depends on (the whole fingerprint
of versions and devices for env, deepspeed-check and install-test; torch/transformers/timm versions
for memory) and the package version. Change one byte of the config and only the
steps that read that byte re-run. Never Prefect's default run-scoped policy; never for a real launch.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
from collections.abc import Mapping
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from prefect_accelerate._version import __version__

_FINGERPRINT_PACKAGES = ("torch", "accelerate", "deepspeed", "transformers", "timm", "prefect", "numpy")


def digest(value: Any) -> str:
    """A short stable hash of any JSON-able value."""
    text = json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def file_digest(path: str | os.PathLike[str] | None) -> str:
    """Hash of a file's bytes ('absent' when there is no such file)."""
    if path is None:
        return "none"
    try:
        return hashlib.sha256(Path(path).expanduser().read_bytes()).hexdigest()[:16]
    except (FileNotFoundError, IsADirectoryError):
        return "absent"


def _package(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "-"


@lru_cache(maxsize=1)
def environment_fingerprint() -> dict[str, str]:
    """What the machine is, cheaply (no torch import): versions, accelerators, host, visible devices."""
    from prefect_accelerate.launchers.host import local_host

    host = local_host()
    facts = {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "accelerator": f"{host.accelerator_kind() or 'cpu'}x{host.accelerator_count()}",
        "gpus": ";".join(name for name, _ in host.nvidia_gpus()),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES", "*"),
        "prefect-accelerate": __version__,
    }
    facts.update({name: _package(name) for name in _FINGERPRINT_PACKAGES})
    return facts


def step_key(step: str, inputs: Mapping[str, str]) -> str:
    """The cache key of a step: its name, its inputs' digests and the package version."""
    return f"pa-{step}-{digest({'step': step, 'inputs': dict(inputs), 'version': __version__})}"
