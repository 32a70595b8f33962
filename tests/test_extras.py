"""What `pip install prefect-accelerate` gives, and what each extra adds (issue 28): a command that needs a package
of a missing extra says so in one paragraph naming the extra, exits 2, and prints no traceback.

Each case runs the real CLI in a child Python where the extra's packages are made absent, as in an environment
that never installed them: a `sitecustomize` on PYTHONPATH swaps Python's path finder for one that finds neither
those modules nor their distribution metadata (so `import x`, `importlib.util.find_spec` and
`importlib.metadata.version` all answer "not installed")."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "prefect_accelerate.cli.main"]

HIDER = '''
import re, sys
from importlib.machinery import PathFinder

HIDDEN = set({hidden!r})

def _hidden(name):
    return name is not None and re.sub(r"[-_.]+", "_", name).lower() in HIDDEN

class _NotInstalled(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if _hidden(name.split(".")[0]) else PathFinder.find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, context=None, **kwargs):
        return [d for d in PathFinder.find_distributions(context, **kwargs) if not _hidden(d.metadata["Name"])]

sys.meta_path[:] = [_NotInstalled if finder is PathFinder else finder for finder in sys.meta_path]
'''

SAGEMAKER_CONFIG = """\
compute_environment: AMAZON_SAGEMAKER
distributed_type: 'NO'
ec2_instance_type: ml.p3.2xlarge
iam_role_name: role
profile: default
region: us-east-1
num_machines: 1
mixed_precision: 'no'
"""

GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 1, "n_embd": 32, "n_head": 2,
        "vocab_size": 100, "n_positions": 64}

#: extra -> (the modules it brings that our code imports, the command that needs them)
CASES = {
    "timm": (["timm", "torchvision"], ["estimate-memory", "resnet50", "--library_name", "timm"]),
    "transformers (a Hub id, offline)": (["huggingface_hub", "transformers"], ["estimate-memory", "some-org/model"]),
    "transformers (a Hub id, online)": (["huggingface_hub", "transformers"], ["estimate-memory", "some-org/model"]),
    "transformers (a local folder)": (["transformers"], ["estimate-memory", "{tmp}/gpt2"]),
    "deepspeed": (["deepspeed"], ["launch", "--use_deepspeed", "--num_processes", "2", "--dry-run", "{tmp}/train.py"]),
    "sagemaker": (["sagemaker"], ["launch", "--config_file", "{tmp}/sagemaker.yaml", "--dry-run", "{tmp}/train.py"]),
    "tpu": (["torch_xla"], ["launch", "--tpu", "--dry-run", "{tmp}/train.py"]),
    "kubernetes": (["kubernetes"], ["launch", "--no-track", "--kubernetes", "--kubernetes_image", "example/train:1",
                                    "--num_machines", "2", "--num_processes", "2", "{tmp}/train.py"]),
}


def extras() -> dict[str, list[str]]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


@pytest.mark.parametrize("case", list(CASES))
def test_a_missing_extra_is_one_paragraph_naming_it_with_exit_2(case, tmp_path):
    extra = case.split(" ")[0]
    hidden, argv = CASES[case]
    (tmp_path / "hider").mkdir()
    (tmp_path / "hider" / "sitecustomize.py").write_text(HIDER.format(hidden=sorted(hidden)))
    (tmp_path / "train.py").write_text("print('never runs')\n")
    (tmp_path / "sagemaker.yaml").write_text(SAGEMAKER_CONFIG)
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(GPT2))
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(PYTHONPATH=str(tmp_path / "hider"), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="0" if "online" in case else "1")
    done = subprocess.run([*CLI, *(a.format(tmp=tmp_path) for a in argv)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr and "never runs" not in done.stdout
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert f"pip install 'prefect-accelerate[{extra}]'" in lines[0], lines[0]
    assert extra in extras()


def test_every_extra_a_message_names_is_defined_in_pyproject():
    named = set()
    for source in (REPO / "prefect_accelerate").rglob("*.py"):
        named |= set(re.findall(r"DependencyError\.missing\(\s*['\"][\w.]+['\"],\s*['\"]([\w-]+)['\"]", source.read_text()))
    assert named and named <= set(extras()), named - set(extras())


def test_the_plain_install_brings_what_sizing_a_transformers_model_or_a_hub_id_needs():
    """huggingface_hub, transformers and safetensors are dependencies of the package itself; timm stays an extra:
    it brings torchvision, which must be the build made for the installed torch."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0].lower() for dep in project["dependencies"]}
    assert {"huggingface_hub", "transformers", "safetensors", "prefect", "torch"} <= names
    assert not {"timm", "torchvision", "deepspeed", "sagemaker"} & names
