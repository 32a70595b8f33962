"""Models for the memory tests, described by configs written locally (nothing comes from the Hub).

`zoo` writes each config once per session with `save_pretrained` (transformers) or by hand (timm's
config.json format), so tests can pass folders exactly as users do.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


TIMM_RESNET50 = {
    "architecture": "resnet50",
    "num_classes": 1000,
    "num_features": 2048,
    "pretrained_cfg": {"tag": "a1_in1k", "input_size": [3, 224, 224], "num_classes": 1000, "mean": [0.485, 0.456, 0.406],
                       "std": [0.229, 0.224, 0.225], "classifier": "fc"},
}


def transformers_configs() -> dict[str, object]:
    import transformers

    tokens = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    return {
        # bert-base-cased: BertConfig defaults with its cased vocabulary
        "bert-base-cased": transformers.BertConfig(vocab_size=28996, architectures=["BertForMaskedLM"]),
        "gpt2": transformers.GPT2Config(architectures=["GPT2LMHeadModel"]),
        "t5": transformers.T5Config(decoder_start_token_id=0, architectures=["T5ForConditionalGeneration"]),
        "llama-3-70b": transformers.LlamaConfig(
            hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
            vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
            rope_theta=500000.0, **tokens),
        "mixtral": transformers.MixtralConfig(architectures=["MixtralForCausalLM"], **tokens),
        "vit": transformers.ViTConfig(architectures=["ViTForImageClassification"]),
        "tiny-gpt2": transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
                                             architectures=["GPT2LMHeadModel"], **tokens),
        "tiny-llama": transformers.LlamaConfig(num_hidden_layers=10, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                                               num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
                                               architectures=["LlamaForCausalLM"], **tokens),
        "tiny-bert": transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128,
                                             vocab_size=128, max_position_embeddings=64, architectures=["BertForSequenceClassification"]),
        "tiny-t5": transformers.T5Config(num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, num_heads=2, d_kv=32,
                                         vocab_size=128, decoder_start_token_id=0, architectures=["T5ForConditionalGeneration"]),
        "tiny-mixtral": transformers.MixtralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                                   num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
                                                   max_position_embeddings=128, architectures=["MixtralForCausalLM"], **tokens),
    }


@pytest.fixture(scope="session")
def zoo(tmp_path_factory) -> dict[str, Path]:
    """name -> folder holding config.json, for every model the memory tests use."""
    root = tmp_path_factory.mktemp("model-zoo")
    folders: dict[str, Path] = {}
    for name, config in transformers_configs().items():
        config.save_pretrained(root / name)
        folders[name] = root / name
    folders["timm-resnet50"] = write_timm_config(root / "timm-resnet50", TIMM_RESNET50)
    return folders


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """A private Hugging Face cache under a temp HF_HOME, seen by huggingface_hub (which reads it at call time)."""
    from huggingface_hub import constants

    home = tmp_path / "hf-home"
    cache = home / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def write_timm_config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def add_to_cache(cache: Path, repo_id: str, config: dict, revision: str = "0123456789abcdef0123456789abcdef01234567",
                 refs: bool = True) -> Path:
    """Lay out `models--org--name/snapshots/REV/config.json` (+ refs/main) by hand, as the Hub client would."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    if refs:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture
def timm_resnet50_config() -> dict:
    """timm's config.json for resnet50.a1_in1k (the Hub's format), as a dict."""
    return json.loads(json.dumps(TIMM_RESNET50))


@pytest.fixture
def cache_entry(hf_cache):
    """Add a repo to the private HF cache: ``cache_entry("org/name", config_dict)`` -> snapshot folder."""
    return lambda repo_id, config, **kwargs: add_to_cache(hf_cache, repo_id, config, **kwargs)


@pytest.fixture(autouse=True)
def own_profile_cache(tmp_path, monkeypatch):
    """Each test its own estimate cache: a test must never be answered from another test's build and trace."""
    monkeypatch.setenv("PREFECT_ACCELERATE_PROFILE_CACHE", str(tmp_path / "memory-profiles"))


def _train_and_measure(folder: Path, shape: dict) -> int:
    """The CPU allocator's peak over 3 AdamW steps of Accelerate's example loop (memory/probe.py's recorder, the
    one `--measure` uses on CPU). ``shape`` gives batch, seq, precision ("no"/"bf16") and checkpointing."""
    from prefect_accelerate.memory.probe import cpu_training_peak

    return cpu_training_peak(folder, shape["batch"], shape["seq"], shape["precision"], shape["checkpointing"])


@pytest.fixture(scope="session")
def train_and_measure():
    return _train_and_measure
