"""A library that is installed but fails to import is one clear paragraph, never a traceback.

The case seen on these machines: a torchvision built for another torch dies at import with
`RuntimeError: operator torchvision::nms does not exist`, and takes `import timm` (and transformers'
vision imports) with it. Here a stand-in torchvision that fails the same way is put first on the path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefect_accelerate.errors import DependencyError, broken_imports_reported, failed_import

CLI = [sys.executable, "-m", "prefect_accelerate.cli.main", "estimate-memory"]
NMS = "RuntimeError: operator torchvision::nms does not exist"


@pytest.fixture
def broken_torchvision(tmp_path) -> dict[str, str]:
    package = tmp_path / "broken" / "torchvision"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from torchvision import _ops\n")
    (package / "_ops.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')\n")
    path = os.pathsep.join(p for p in (str(tmp_path / "broken"), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *argv, "--no-track"], capture_output=True, text=True, timeout=180, env=env)


@pytest.mark.slow
def test_a_timm_model_with_a_broken_torchvision_names_torchvision_and_the_fix(broken_torchvision):
    done = run(["resnet18", "--library_name", "timm"], broken_torchvision)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    message = done.stderr.strip()
    assert message.count("\n") == 0, message
    assert f"Sizing `resnet18` imports `torchvision`, which is installed but fails to import ({NMS})" in message
    assert "built for another torch" in message and "pip uninstall torchvision" in message


@pytest.mark.slow
def test_a_bare_name_says_timm_names_could_not_be_checked(broken_torchvision):
    done = run(["resnet18"], broken_torchvision)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert f"timm names could not be checked (timm is installed, but importing `torchvision` fails: {NMS})" in done.stderr


@pytest.mark.slow
def test_this_machines_own_torchvision_without_the_test_shim_gives_a_table_or_the_clear_error(tmp_path):
    """No stand-in: the venv as a user has it (the tests' torchvision shim taken off the path)."""
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path / "gpt2")
    shims = str(Path(__file__).resolve().parents[1] / "shims")
    path = os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != Path(shims).resolve())
    # and without the start-up hook ./dev adds to .venv where torchvision cannot load its operators (dev, docs/testing.md)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PREFECT_ACCELERATE_TORCHVISION_HOOK": "0"}
    done = run([str(tmp_path / "gpt2")], env)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    if done.returncode == 0:
        assert "Memory Usage for loading" in done.stdout or "Total Size" in done.stdout, done.stdout
    else:
        assert done.returncode == 2 and "which is installed but fails to import" in done.stderr, done.stderr


def test_an_error_raised_while_a_module_is_imported_names_its_package(tmp_path, monkeypatch):
    (tmp_path / "halfinstalled").mkdir()
    (tmp_path / "halfinstalled" / "__init__.py").write_text("from halfinstalled import core\n")
    (tmp_path / "halfinstalled" / "core.py").write_text("raise OSError('libhalf.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(DependencyError) as caught:
        with broken_imports_reported("Sizing `m`"):
            import halfinstalled  # noqa: F401
    assert caught.value.message.startswith("Sizing `m` imports `halfinstalled`, which is installed but fails to import "
                                           "(OSError: libhalf.so: cannot open shared object file)")
    assert "Reinstall `halfinstalled`" in caught.value.message


def test_an_error_that_no_import_caused_goes_on_unchanged():
    def build() -> None:
        raise RuntimeError("shape mismatch in layer 3")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        with broken_imports_reported("Sizing `m`"):
            build()
    try:
        build()
    except RuntimeError as error:
        assert failed_import(error) is None
