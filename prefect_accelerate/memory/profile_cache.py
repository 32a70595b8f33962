"""A cache of what building and tracing a model measured, so a repeat estimate imports neither torch nor transformers.

Importing torch and transformers' modeling code is most of an estimate's time (about 4.8 s of 5.2 s for a
70B-shaped Llama on these machines; the build and trace take under a second). What they measure, Accelerate's
table figures and the `ModelProfile`, depends only on the model's description, the library versions and
the few options that change the traced forward, not on the layout: another ``--num_processes``,
``--strategy`` with the same precision mode, ``--offload``, ``--optimizer`` or ``--device_memory`` is
arithmetic over the same profile. ``--gradient_checkpointing`` reaches the trace (a model's code may take
another path under checkpointing: T5's position bias then requires grad), so it is part of the key. The CLI
keeps each measurement as a small JSON file under the cache folder and reuses it when everything it depends
on is unchanged.

The key: the config's content hash (with the remote code files, for ``auto_map`` models), the library,
the installed versions of torch, transformers and timm, this package's version and the size and
modification time of every file of prefect_accelerate/memory (an edited estimator is a new key), the
options that reach the trace, and the GPUs of this machine when no ``--cuda_capability`` is given.
``PREFECT_ACCELERATE_PROFILE_CACHE`` names the folder (``off`` turns the cache off); the default is
``<PREFECT_ACCELERATE_CACHE_DIR or ~/.cache/prefect-accelerate>/memory-profiles``.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from prefect_accelerate._version import __version__
from prefect_accelerate.memory.models import EstimateOptions, ModelSource

PROFILE_CACHE_ENV = "PREFECT_ACCELERATE_PROFILE_CACHE"
#: Options that only change the arithmetic over a profile, never the build or the trace.
_LAYOUT_ONLY = ("strategy", "num_processes", "num_machines", "offload", "optimizer", "dtypes",
                "reduce_bucket_size", "overlap_comm", "contiguous_gradients", "prefetch_bucket_size", "max_live_parameters", "max_reuse_distance",
                "sub_group_size")
SCHEMA = 1


def cache_folder() -> Path | None:
    chosen = os.environ.get(PROFILE_CACHE_ENV, "")
    if chosen.lower() == "off":
        return None
    if chosen:
        return Path(os.path.expanduser(chosen))
    from prefect_accelerate.launchers.state import cache_dir

    return cache_dir() / "memory-profiles"


def _installed(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "-"


def _estimator_files() -> list[tuple[str, int, int]]:
    here = Path(__file__).resolve().parent
    return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(here.glob("*.py"))]


def _gpus() -> list[str]:
    folder = Path("/proc/driver/nvidia/gpus")
    return sorted(os.listdir(folder)) if folder.is_dir() else []


def cache_key(source: ModelSource, options: EstimateOptions) -> str:
    from prefect_accelerate.memory.strategies import precision_mode

    traced = {k: v for k, v in options.model_dump(mode="json").items() if k not in _LAYOUT_ONLY}
    traced["precision_mode"] = precision_mode(options) if options.strategy else None
    payload = {
        "schema": SCHEMA, "config": source.config_sha256, "library": source.library, "options": traced,
        "versions": {name: _installed(name) for name in ("torch", "transformers", "timm")},
        "prefect_accelerate": __version__, "estimator": _estimator_files(),
        "gpus": _gpus() if options.cuda_capability is None else [],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def load(key: str) -> dict[str, Any] | None:
    folder = cache_folder()
    if folder is None:
        return None
    try:
        data = json.loads((folder / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None  # absent or unreadable: measure again
    return data if isinstance(data, dict) and data.get("schema") == SCHEMA else None


def store(key: str, data: dict[str, Any]) -> None:
    folder = cache_folder()
    if folder is None:
        return
    from prefect_accelerate.launchers.state import write_private_json

    try:
        write_private_json(folder / f"{key}.json", {"schema": SCHEMA, **data}, "memory profile cache folder")
    except Exception:  # noqa: BLE001 - a cache that cannot be written only costs time
        return
