"""Which model is measured: Accelerate's class for the table, the trained class (head, ties once) for the breakdown."""

from __future__ import annotations

import json
import textwrap

import pytest

from prefect_accelerate.errors import EstimateError
from prefect_accelerate.memory import EstimateOptions, estimate

PROFILE_ONLY = {"dtypes": ("float32",), "strategy": "ddp", "activations": False}


def test_gpt2_lm_head_is_tied_so_the_trained_model_has_no_extra_parameters(zoo):
    result = estimate(str(zoo["gpt2"]), EstimateOptions(**PROFILE_ONLY))
    assert result.table.measured_class == "GPT2Model"
    assert result.breakdown.trained_class == "GPT2LMHeadModel"
    # 124,439,808: GPT-2 small's own count; init_empty_weights' untied head would add 38.6 M
    assert result.profile.parameters == 124_439_808
    assert result.table.rows[0].total_bytes == 4 * 124_439_808


def test_untied_llama_head_is_counted_on_top_of_accelerates_base_model(zoo):
    result = estimate(str(zoo["llama-3-70b"]), EstimateOptions(**PROFILE_ONLY))
    lm_head = 128256 * 8192
    assert result.profile.parameters == 70_553_706_496
    assert 4 * result.profile.parameters - result.table.rows[0].total_bytes == 4 * lm_head - 512  # minus rotary buffer


def test_model_class_option_overrides_architectures(zoo):
    result = estimate(str(zoo["tiny-gpt2"]), EstimateOptions(**PROFILE_ONLY, model_class="AutoModelForSequenceClassification"))
    assert result.breakdown.trained_class == "GPT2ForSequenceClassification"


def test_config_without_architectures_uses_the_causal_lm_class(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2,
                                                      "vocab_size": 64, "n_positions": 32}))
    assert estimate(str(tmp_path), EstimateOptions(**PROFILE_ONLY)).breakdown.trained_class == "GPT2LMHeadModel"


def test_unknown_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2ForTimeTravel"], "n_layer": 1}))
    with pytest.raises(EstimateError, match="names `GPT2ForTimeTravel`, which transformers .* does not have"):
        estimate(str(tmp_path), EstimateOptions(**PROFILE_ONLY))


def test_unknown_model_type_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not-a-model-type"}))
    with pytest.raises(EstimateError, match="does not know the model type `not-a-model-type`"):
        estimate(str(tmp_path))


def test_timm_config_naming_an_unknown_architecture_is_a_clear_error(tmp_path):
    pytest.importorskip("timm")
    (tmp_path / "config.json").write_text(json.dumps({"architecture": "resnet9000", "num_classes": 10}))
    with pytest.raises(EstimateError, match="has no architecture `resnet9000`"):
        estimate(str(tmp_path))


@pytest.fixture
def remote_code_model(tmp_path):
    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "configuration_tiny.py").write_text(textwrap.dedent('''
        from transformers import PretrainedConfig

        class TinyConfig(PretrainedConfig):
            model_type = "tiny-custom"

            def __init__(self, hidden=32, vocab=64, **kwargs):
                self.hidden = hidden
                self.vocab = vocab
                super().__init__(**kwargs)
    '''))
    (folder / "modeling_tiny.py").write_text(textwrap.dedent('''
        import torch
        from transformers import PreTrainedModel
        from .configuration_tiny import TinyConfig

        class TinyForCausalLM(PreTrainedModel):
            config_class = TinyConfig

            def __init__(self, config):
                super().__init__(config)
                self.embed = torch.nn.Embedding(config.vocab, config.hidden)
                self.head = torch.nn.Linear(config.hidden, config.vocab, bias=False)
                self.post_init()

            def forward(self, input_ids, labels=None):
                logits = self.head(self.embed(input_ids))
                loss = None
                if labels is not None:
                    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
                return {"loss": loss, "logits": logits}
    '''))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "tiny-custom", "hidden": 32, "vocab": 64, "architectures": ["TinyForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_tiny.TinyConfig", "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"},
    }))
    return folder


def test_remote_code_without_trust_is_refused_with_the_flag_to_pass(remote_code_model):
    with pytest.raises(EstimateError, match="ships its own modeling code.*--trust_remote_code"):
        estimate(str(remote_code_model))


def test_remote_code_with_trust_builds_the_auto_map_class(remote_code_model):
    result = estimate(str(remote_code_model), EstimateOptions(dtypes=("float32",), strategy="ddp", trust_remote_code=True, seq_len=16))
    assert result.table.measured_class == "TinyForCausalLM"  # Accelerate: the first AutoModelFor* of auto_map
    assert result.profile.parameters == 2 * 32 * 64
    assert result.table.rows[0].total_bytes == 4 * 2 * 32 * 64
    assert result.breakdown.activations_method == "traced"


def test_remote_code_changes_the_config_hash(remote_code_model):
    from prefect_accelerate.memory.resolve import resolve_model

    before = resolve_model(str(remote_code_model)).config_sha256
    (remote_code_model / "modeling_tiny.py").write_text((remote_code_model / "modeling_tiny.py").read_text() + "\n# changed\n")
    assert resolve_model(str(remote_code_model)).config_sha256 != before
