"""Golden files: compare a JSON-able value with tests/golden/<name>.json (UPDATE_GOLDEN=1 rewrites them)."""

from __future__ import annotations

import json
import os
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent.parent / "golden"


def assert_golden(name: str, value) -> None:
    path = GOLDEN / f"{name}.json"
    text = json.dumps(value, indent=2, sort_keys=True) + "\n"
    if os.environ.get("UPDATE_GOLDEN") == "1" or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if os.environ.get("UPDATE_GOLDEN") != "1":
            raise AssertionError(f"golden file {path} did not exist; it was written now: review and commit it")
    assert json.loads(text) == json.loads(path.read_text()), f"plan differs from {path} (UPDATE_GOLDEN=1 to accept)"


def normalize_plan(data: dict, *, run_dir: str | None, cwd: str) -> dict:
    """Replace machine-specific paths with placeholders so golden files are stable."""
    def fix(text: str) -> str:
        if run_dir:
            text = text.replace(run_dir, "RUN_DIR")
        return text.replace(cwd, "CWD")

    out = json.loads(json.dumps(data))
    out["argv"] = [fix(a) for a in out["argv"]]
    out["env"] = {k: fix(v) for k, v in out["env"].items()}
    out["cwd"] = fix(out["cwd"])
    return out
