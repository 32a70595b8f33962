"""The environment `./dev` builds runs every command the README shows, whatever `./dev test` added to it (issue 28):
after the test install, transformers and timm still import in .venv and estimate-memory sizes a local transformers
folder and a timm name. Run as a user runs them: a child process without the tests' own torchvision shim."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHIMS = REPO / "tests" / "shims"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(Path(sys.prefix).resolve() != (REPO / ".venv").resolve(), reason="checks the .venv that ./dev builds"),
]


def user_env(tmp_path: Path) -> dict[str, str]:
    """This session's environment less the test shim on PYTHONPATH: what a user's shell in .venv has."""
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != SHIMS.resolve()]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}


def test_transformers_and_timm_import_in_the_venv_dev_built(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import transformers, timm, torchvision"], capture_output=True, text=True,
                          env=user_env(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("model", ["local transformers folder", "timm name"])
def test_estimate_memory_as_the_readme_shows_it_works_in_the_venv_dev_built(tmp_path, model):
    from transformers import GPT2Config

    if model == "timm name":
        argv = ["resnet50", "--library_name", "timm"]
    else:
        GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path / "my-model")
        argv = ["./my-model"]
    done = subprocess.run([str(Path(sys.prefix) / "bin" / "prefect-accelerate"), "estimate-memory", *argv], capture_output=True,
                          text=True, env=user_env(tmp_path), cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "float32" in done.stdout and "int4" in done.stdout, done.stdout
