"""A small index of finished preflight steps, so `plan` can say "cached" or "would run because X changed"
without starting Prefect.

<state>/pipeline/keys/<key>              one marker per step key that completed
<state>/pipeline/<pipeline id>/<step>.json  the inputs of that step's last successful run

Prefect's own cache (keyed by the same keys) decides what actually runs; this index only explains.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from prefect_accelerate.launchers.state import make_private_dir, state_dir


def _root() -> Path:
    return state_dir() / "pipeline"


def has_key(key: str) -> bool:
    return (_root() / "keys" / key).exists()


def last_record(pipeline_id: str, step: str) -> dict[str, Any] | None:
    try:
        return json.loads((_root() / pipeline_id / f"{step}.json").read_text())
    except (OSError, ValueError):
        return None


def record(pipeline_id: str, step: str, key: str, inputs: dict[str, str]) -> None:
    """Remember that `step` completed with `key` (atomic writes; safe to call from several processes)."""
    marker = _root() / "keys" / key
    make_private_dir(marker.parent, "state folder")
    marker.write_text(f"{time.time()}\n")
    folder = _root() / pipeline_id
    make_private_dir(folder, "state folder")
    target = folder / f"{step}.json"
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    # the facts behind the "environment" digest, so `plan` can say which of them changed, not only that one did
    from prefect_accelerate.pipeline.keys import environment_fingerprint

    tmp.write_text(json.dumps({"key": key, "inputs": inputs, "environment": environment_fingerprint(),
                               "finished_at": time.time()}, indent=1))
    os.replace(tmp, target)
