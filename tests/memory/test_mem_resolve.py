"""Finding the model: local folders, the HF cache offline, timm names, and the Hub (mocked: no network)."""

from __future__ import annotations

import json
import types

import pytest

from prefect_accelerate.errors import EstimateError
from prefect_accelerate.memory import EstimateOptions, estimate
from prefect_accelerate.memory import resolve as resolve_module
from prefect_accelerate.memory.resolve import resolve_model

TINY_GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 128, "n_positions": 64,
             "bos_token_id": 0, "eos_token_id": 0, "architectures": ["GPT2LMHeadModel"]}


def test_local_folder_is_read_with_library_from_config(zoo):
    source = resolve_model(str(zoo["tiny-gpt2"]))
    assert (source.kind, source.library) == ("local", "transformers")
    assert len(source.config_sha256) == 64


def test_path_to_config_json_means_its_folder(zoo):
    assert resolve_model(str(zoo["tiny-gpt2"] / "config.json")).location == str(zoo["tiny-gpt2"].resolve())


def test_timm_folder_is_recognised_by_its_architecture_key(zoo):
    assert resolve_model(str(zoo["timm-resnet50"])).library == "timm"


def test_config_hash_follows_content_not_path(zoo, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_bytes((zoo["tiny-gpt2"] / "config.json").read_bytes())
    assert resolve_model(str(copy)).config_sha256 == resolve_model(str(zoo["tiny-gpt2"])).config_sha256
    (copy / "config.json").write_text(json.dumps({**TINY_GPT2, "n_layer": 3}))
    assert resolve_model(str(copy)).config_sha256 != resolve_model(str(zoo["tiny-gpt2"])).config_sha256


def test_folder_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(EstimateError, match=r"has no config\.json"):
        resolve_model(str(tmp_path))


def test_broken_config_json_names_the_file_and_the_position(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2",,}')
    with pytest.raises(EstimateError, match=r"config\.json .* is not valid JSON: .*line 1 column"):
        resolve_model(str(tmp_path))


def test_config_that_is_not_an_object_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(EstimateError, match="JSON list, not an object"):
        resolve_model(str(tmp_path))


def test_config_without_library_markers_asks_for_library_name(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden": 3}')
    with pytest.raises(EstimateError, match="--library_name"):
        resolve_model(str(tmp_path))


def test_missing_path_is_reported_as_a_path(tmp_path):
    with pytest.raises(EstimateError, match="looks like a path, but there is no folder"):
        resolve_model(str(tmp_path / "nope"))


def test_hub_id_in_the_hf_cache_works_offline(cache_entry):
    snapshot = cache_entry("org/tiny-model", TINY_GPT2)
    source = resolve_model("org/tiny-model")
    assert (source.kind, source.library, source.location) == ("hf-cache", "transformers", str(snapshot))
    table = estimate("org/tiny-model", EstimateOptions(dtypes=("float32",))).table
    assert table.title == "Memory Usage for loading `org/tiny-model`"
    assert table.measured_class == "GPT2Model"


def test_cache_entry_without_refs_main_is_not_found_and_offline_says_so(cache_entry):
    cache_entry("org/norefs", TINY_GPT2, refs=False)
    with pytest.raises(EstimateError, match="not in the Hugging Face cache .* HF_HUB_OFFLINE=1"):
        resolve_model("org/norefs")


def test_timm_architecture_name(zoo):
    pytest.importorskip("timm")
    source = resolve_model("resnet50.a1_in1k")
    assert (source.kind, source.library, source.location) == ("timm", "timm", "resnet50.a1_in1k")


def test_unknown_timm_name_suggests_a_close_one():
    pytest.importorskip("timm")
    with pytest.raises(EstimateError, match="not a timm architecture.*Did you mean `resnet50`"):
        resolve_model("resnet5O", library_name="timm")


def test_unknown_bare_name_offline_lists_where_we_looked():
    pytest.importorskip("timm")
    with pytest.raises(EstimateError, match="not a timm architecture name, and HF_HUB_OFFLINE=1"):
        resolve_model("definitely-not-a-model")


# ------------------------------------------------------------------------------------------ the Hub, mocked


def http_error(cls, status: int):
    import httpx2

    response = httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co/api/models/x"))
    return cls(f"{status} error", response=response)


@pytest.fixture
def online(monkeypatch):
    """Pretend the Hub is reachable; each test decides what `model_info` answers."""
    import huggingface_hub

    monkeypatch.setattr(resolve_module, "hub_offline", lambda: False)

    def answer(result):
        def model_info(repo_id, **kwargs):
            if isinstance(result, Exception):
                raise result
            return result

        monkeypatch.setattr(huggingface_hub, "model_info", model_info)

    return answer


def test_gated_repo_has_its_own_message(online):
    from huggingface_hub.errors import GatedRepoError

    online(http_error(GatedRepoError, 403))
    with pytest.raises(EstimateError, match="is gated: .* accepted its terms"):
        resolve_model("meta-llama/Llama-3.1-8B")


def test_missing_repo_is_not_reported_as_gated(online):
    from huggingface_hub.errors import RepositoryNotFoundError

    online(http_error(RepositoryNotFoundError, 404))
    with pytest.raises(EstimateError, match="has no model repo `org/missing`") as error:
        resolve_model("org/missing")
    assert "gated" not in str(error.value)


def test_repo_without_library_metadata_asks_for_library_name(online):
    online(types.SimpleNamespace(library_name=None))
    with pytest.raises(EstimateError, match="has no library metadata.*--library_name"):
        resolve_model("org/no-metadata")


def test_unsupported_library_is_named(online):
    online(types.SimpleNamespace(library_name="diffusers"))
    with pytest.raises(EstimateError, match="is a `diffusers` model"):
        resolve_model("org/pipeline")


def test_network_failure_is_not_called_gated(online):
    online(ConnectionError("Name or service not known"))
    with pytest.raises(EstimateError, match="Could not ask the Hugging Face Hub.*Name or service not known"):
        resolve_model("org/anything")


def test_hub_repo_downloads_only_its_config_and_builds(online, cache_entry, monkeypatch):
    import huggingface_hub

    online(types.SimpleNamespace(library_name="transformers"))
    downloads = []

    def hf_hub_download(repo_id, filename, **kwargs):
        downloads.append(filename)
        return str(cache_entry(repo_id, TINY_GPT2) / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    result = estimate("org/online-model", EstimateOptions(dtypes=("float32",), strategy="ddp", activations=False))
    assert downloads == ["config.json"]
    assert result.source.kind == "hub"
    assert result.breakdown.trained_class == "GPT2LMHeadModel"
