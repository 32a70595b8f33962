"""A cold `estimate-memory` of a text model keeps torchvision and scipy out of the process; vision models still estimate.

transformers imports its image/video helpers (and through them torchvision) and its detection losses
(scipy) on every model's path; memory/lean_imports.py makes those libraries look absent for a text model
whose modeling module never names them. Each check runs the real command in a fresh process.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefect_accelerate.memory import EstimateOptions, estimate
from prefect_accelerate.memory.lean_imports import hidden, unused_libraries

# Runs the real CLI in-process in a fresh interpreter, then says which optional libraries got imported.
CHILD = """
import json, sys
from prefect_accelerate.cli.main import main
code = main(["estimate-memory", *sys.argv[1:], "--no-track", "--json"])
loaded = [name for name in ("torchvision", "scipy", "boto3", "timm") if sys.modules.get(name) is not None]
print("LOADED=" + json.dumps(loaded), file=sys.stderr)
sys.exit(code)
"""
LAYOUT = ["--strategy", "zero2", "--num_processes", "2", "--mixed_precision", "bf16", "--batch_size", "2", "--seq_len", "32"]


def run_child(argv: list[str], env: dict[str, str] | None = None) -> tuple[dict, list[str]]:
    env = {**(env or os.environ), "PREFECT_ACCELERATE_PROFILE_CACHE": "off", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stderr.rsplit("LOADED=", 1)[1].splitlines()[0])
    return json.loads(done.stdout), loaded


def same_numbers(cli: dict, folder: Path, options: EstimateOptions) -> None:
    """The command's estimate equals the library API's, which hides nothing."""
    here = estimate(str(folder), options).model_dump(mode="json")
    for part in ("table", "profile", "breakdown"):
        assert cli["estimate"][part] == here[part], part


OPTIONS = EstimateOptions(strategy="zero2", num_processes=2, mixed_precision="bf16", batch_size=2, seq_len=32)


@pytest.mark.slow
def test_a_text_model_estimate_imports_no_torchvision_scipy_or_boto3_and_its_numbers_are_unchanged(zoo):
    cli, loaded = run_child([str(zoo["tiny-llama"]), *LAYOUT])
    assert loaded == []
    assert cli["estimate"]["breakdown"] is not None
    same_numbers(cli, zoo["tiny-llama"], OPTIONS)


@pytest.mark.slow
def test_a_text_model_estimates_even_with_a_torchvision_that_fails_to_import(zoo, tmp_path):
    """The broken wheel of these machines ('operator torchvision::nms does not exist') used to stop a GPT-2 estimate."""
    package = tmp_path / "broken" / "torchvision"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "broken"), os.environ.get("PYTHONPATH", "")])}
    cli, loaded = run_child([str(zoo["tiny-gpt2"]), *LAYOUT], env)
    assert loaded == []
    assert cli["estimate"]["table"]


@pytest.mark.slow
def test_a_transformers_vision_model_still_estimates_the_same_numbers(zoo):
    options = EstimateOptions(strategy="ddp", num_processes=1, batch_size=1)
    cli, _ = run_child([str(zoo["vit"]), "--strategy", "ddp", "--batch_size", "1"])
    assert cli["estimate"]["profile"]["trained_class"] == "ViTForImageClassification"
    same_numbers(cli, zoo["vit"], options)


@pytest.mark.slow
def test_a_timm_model_keeps_torchvision_and_estimates(zoo):
    cli, loaded = run_child([str(zoo["timm-resnet50"]), "--strategy", "ddp", "--batch_size", "1"])
    assert "torchvision" in loaded and "timm" in loaded
    assert cli["estimate"]["breakdown"] is not None


def test_only_libraries_the_models_own_modeling_code_never_names_are_hidden():
    assert unused_libraries("transformers", {"model_type": "llama"}) == ("torchvision", "scipy", "boto3")
    # DETR's modeling module imports torchvision's ops (and its loss uses scipy's matcher): both stay
    assert unused_libraries("transformers", {"model_type": "detr"}) == ()
    assert unused_libraries("timm", {"architecture": "resnet50"}) == ()


def test_composite_remote_code_and_unknown_models_hide_nothing():
    llava = {"model_type": "llava", "vision_config": {"model_type": "clip_vision_model"}, "text_config": {"model_type": "llama"}}
    assert unused_libraries("transformers", llava) == ()
    assert unused_libraries("transformers", {"model_type": "llama", "auto_map": {"AutoModel": "m.M"}}) == ()
    assert unused_libraries("transformers", {"model_type": "no_such_model_type"}) == ()
    assert unused_libraries("transformers", {}) == ()
    assert unused_libraries("transformers", None) == ()


def test_hiding_makes_import_fail_inside_the_block_and_leaves_no_trace_after_it():
    import importlib.util

    installed = "wave"  # a standard-library module nothing here imports
    assert installed not in sys.modules and importlib.util.find_spec(installed) is not None
    with hidden(("json", installed)) as hid:
        assert hid == (installed,)  # json is imported already: never hidden
        assert importlib.util.find_spec(installed) is None
        with pytest.raises(ImportError):
            __import__(installed)
        assert sys.modules["json"] is json
    assert installed not in sys.modules
    assert importlib.import_module(installed).__name__ == installed
