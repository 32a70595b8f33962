"""bench/memory_accuracy_cuda.py runs where only torch, transformers and timm are installed (GPU machines)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent.parent / "bench" / "memory_accuracy_cuda.py"

# refuse prefect and pydantic, as on a GPU machine that has neither
_BLOCK = """
import sys
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('prefect', 'pydantic'):
            raise ImportError(f'{name} is not installed here')
        return None
sys.meta_path.insert(0, _Absent())
"""


def _run(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCK + code], capture_output=True, text=True, timeout=timeout)


def test_the_grid_lists_without_prefect_pydantic_or_torch():
    done = _run(f"import runpy, sys\nbench = runpy.run_path({str(BENCH)!r}, run_name='bench')\n"
                "assert bench['main'](['--list']) == 0\n"
                "assert 'torch' not in sys.modules, 'torch was imported'\n")
    assert done.returncode == 0, done.stderr
    names = done.stdout.splitlines()
    assert len(names) >= 15
    for family in ("llama", "gpt2", "bert", "t5", "vit", "eager", "checkpointing", "fp32", "bf16", "16x2048", "hd90", "hd68",
                   "gqa", "16384", "bart"):
        assert any(family in name for name in names), family


@pytest.mark.slow  # a fresh interpreter importing torch and transformers
def test_the_measuring_loop_trains_a_case_without_prefect_or_pydantic():
    case = {"name": "tiny", "library": "transformers", "mixed_precision": "bf16", "batch_size": 2, "seq_len": 16,
            "attn_implementation": "eager", "gradient_checkpointing": True,
            "config": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_hidden_layers": 2,
                       "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64}}
    done = _run(
        "import runpy, json, torch\n"
        f"bench = runpy.run_path({str(BENCH)!r}, run_name='bench')\n"
        f"case = json.loads({json.dumps(case)!r})\n"
        "model = bench['build_model'](case, 'cpu')\n"
        "opt = torch.optim.AdamW(model.parameters())\n"
        "batch = bench['batch_for'](case, model, 'cpu')\n"
        "before = [p.detach().clone() for p in model.parameters()]\n"
        "out = bench['train_step'](case, model, opt, batch, 'cpu')\n"
        "assert torch.isfinite(out.loss) and model.is_gradient_checkpointing\n"
        "assert model.config._attn_implementation == 'eager'\n"
        "assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters())), 'no step was taken'\n"
        "assert all(p.grad is None for p in model.parameters())\n"
        "import sys; assert 'prefect' not in sys.modules and 'pydantic' not in sys.modules\n"
        "print('trained')\n"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "trained" in done.stdout



def test_every_grid_case_describes_a_config_transformers_accepts():
    import runpy

    from prefect_accelerate.memory.measured import transformers_config

    bench = runpy.run_path(str(BENCH), run_name="bench")
    for case in bench["grid"]():
        if case["library"] == "transformers":
            config = transformers_config(case)
            assert config.architectures, case["name"]
            if "hd" in case["name"]:  # the odd head dims the grid exists to measure
                assert (config.hidden_size // config.num_attention_heads) % 8, case["name"]


def test_the_measuring_loop_keeps_one_steps_outputs_as_accelerates_loop_does():
    """`outputs = model(**batch)`: the step before's outputs die when the next forward returns, before backward."""
    import gc
    import weakref

    from prefect_accelerate.memory.measured import batch_for, build_model, train_step

    case = {"name": "tiny", "library": "transformers", "mixed_precision": "no", "batch_size": 2, "seq_len": 8,
            "config": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 16, "num_hidden_layers": 1,
                       "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 32}}
    import torch

    model = build_model(case, "cpu")
    optimizer = torch.optim.AdamW(model.parameters())
    batch = batch_for(case, model, "cpu")
    kept: dict = {}
    train_step(case, model, optimizer, batch, "cpu", kept)
    first = weakref.ref(kept["outputs"].logits)
    seen_during_backward = []
    hook = model.lm_head.register_full_backward_hook(lambda *args: seen_during_backward.append(first() is not None))
    train_step(case, model, optimizer, batch, "cpu", kept)
    hook.remove()
    gc.collect()
    assert seen_during_backward == [False]  # gone before the second step's backward
    assert first() is None and kept["outputs"].logits is not None
