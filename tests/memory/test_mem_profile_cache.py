"""The estimate cache (memory/profile_cache.py): a repeat estimate imports neither torch nor transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from prefect_accelerate.memory import EstimateOptions, estimate
from prefect_accelerate.memory.profile_cache import cache_folder

REPEAT = """
import json, sys
from prefect_accelerate.memory import EstimateOptions, estimate
est = estimate(sys.argv[1], EstimateOptions(strategy=sys.argv[2], num_processes=2, mixed_precision="bf16", seq_len=64), cache=True)
print(json.dumps({"total": est.breakdown.device_total_bytes, "torch": "torch" in sys.modules,
                  "transformers": "transformers" in sys.modules}))
"""


def _run(folder, strategy: str) -> dict:
    done = subprocess.run([sys.executable, "-c", REPEAT, str(folder), strategy], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_repeat_estimate_and_another_layout_come_from_the_cache_without_importing_torch(zoo):
    first = _run(zoo["tiny-llama"], "zero2")
    assert first["torch"] and first["transformers"]
    again = _run(zoo["tiny-llama"], "zero2")
    assert again == {**first, "torch": False, "transformers": False}
    other = _run(zoo["tiny-llama"], "zero3")  # same precision mode (16-bit weights): the same profile
    assert not other["torch"] and other["total"] != first["total"]
    direct = estimate(str(zoo["tiny-llama"]), EstimateOptions(strategy="zero3", num_processes=2, mixed_precision="bf16", seq_len=64))
    assert other["total"] == direct.breakdown.device_total_bytes


def test_a_changed_config_or_traced_option_is_measured_again(zoo, tmp_path):
    import transformers

    folder = tmp_path / "m"
    transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
                            architectures=["GPT2LMHeadModel"]).save_pretrained(folder)
    options = EstimateOptions(strategy="ddp", seq_len=32)
    first = estimate(str(folder), options, cache=True)
    estimate(str(folder), options.model_copy(update={"seq_len": 16}), cache=True)
    assert len(list(cache_folder().glob("*.json"))) == 2
    # checkpointing reaches the trace: the model's own code may take another path under it (T5's position bias)
    estimate(str(folder), options.model_copy(update={"gradient_checkpointing": True}), cache=True)
    assert len(list(cache_folder().glob("*.json"))) == 3
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_layer": 3}))
    deeper = estimate(str(folder), options, cache=True)
    assert len(list(cache_folder().glob("*.json"))) == 4
    assert deeper.profile.parameters > first.profile.parameters


def test_the_cache_can_be_turned_off(zoo, monkeypatch):
    monkeypatch.setenv("PREFECT_ACCELERATE_PROFILE_CACHE", "off")
    assert cache_folder() is None
    estimate(str(zoo["tiny-gpt2"]), EstimateOptions(strategy="ddp", seq_len=16), cache=True)  # works, keeps nothing
