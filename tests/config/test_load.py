"""Loading config files: formats, migrations, validation errors, default-path resolution."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefect_accelerate.config.io import load_config_file, load_config_path, read_raw
from prefect_accelerate.config.model import ClusterConfig, SageMakerConfig, as_bool
from prefect_accelerate.config.paths import default_config_path, find_default_config, hf_cache_home
from prefect_accelerate.errors import ConfigError

SAMPLES = Path(__file__).resolve().parent.parent / "fixtures" / "configs"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_every_sample_of_the_current_format_loads():
    for name in ["current_single.yaml", "fsdp1_current.yaml", "fsdp2_parallelism.yaml", "deepspeed_zero3_multinode.yaml", "megatron.yaml", "mpi_multicpu.yaml", "multinode_c10d.json"]:
        loaded = load_config_path(SAMPLES / name)
        assert isinstance(loaded.config, ClusterConfig), name


def test_unquoted_no_is_read_as_the_text_no(tmp_path):
    loaded = load_config_path(SAMPLES / "sagemaker_unquoted.yaml")
    assert isinstance(loaded.config, SageMakerConfig)
    assert loaded.config.distributed_type == "NO"
    # a repeated key keeps its last value, as YAML loaders do
    assert loaded.config.debug is False
    plain = load_config_path(write(tmp_path / "c.yaml", "distributed_type: NO\nmixed_precision: no\n"))
    assert plain.config.distributed_type == "NO" and plain.config.mixed_precision == "no"


def test_legacy_fp16_flag_becomes_mixed_precision():
    loaded = load_config_path(SAMPLES / "era1_fp16_flag.yaml")
    assert loaded.config.mixed_precision == "fp16"
    assert "fp16" not in loaded.config.to_dict()
    assert any("fp16" in change for change in loaded.migration.changes)


def test_legacy_dynamo_backend_moves_into_dynamo_config():
    loaded = load_config_path(SAMPLES / "era3_dynamo_backend.yaml")
    assert loaded.config.dynamo_config.dynamo_backend == "INDUCTOR"
    off = load_config_path(SAMPLES / "era3_dynamo_off.yaml")
    assert off.config.to_dict().get("dynamo_config") is None  # NO replaces the whole section


def test_missing_num_processes_is_one_for_distributed_type_no():
    assert load_config_path(SAMPLES / "era2_downcast_text.yaml").config.num_processes == 1


def test_unprefixed_nested_keys_keep_their_spelling_and_reach_launch_names():
    config = load_config_path(SAMPLES / "era3_dynamo_backend.yaml").config
    assert config.fsdp_config.launch_items()["fsdp_sharding_strategy"] == "SHARD_GRAD_OP"
    assert "sharding_strategy" in config.to_dict()["fsdp_config"]


def test_questionnaire_fp8_names_are_read_as_the_names_the_runtime_uses():
    config = load_config_path(SAMPLES / "fp8_questionnaire_keys.yaml").config
    assert config.fp8_config.launch_items()["fp8_amax_history_len"] == 256
    assert config.fp8_config.launch_items()["fp8_amax_compute_algo"] == "most_recent"
    assert config.to_dict()["fp8_config"]["amax_history_length"] == 256


def test_json_and_yaml_are_chosen_by_extension(tmp_path):
    data = {"distributed_type": "MULTI_CPU", "num_processes": 2, "use_cpu": True}
    json_file = write(tmp_path / "c.json", json.dumps(data))
    assert load_config_path(json_file).config.num_processes == 2
    # JSON text is valid YAML too, so a .yaml name holding JSON (Accelerate's `config default`) loads
    assert load_config_path(write(tmp_path / "c.yaml", json.dumps(data))).config.num_processes == 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("distributed_type: NO\nnum_procesess: 2\n", ["unknown key", "`num_procesess`", "did you mean `num_processes`"]),
        ("distributed_type: SUPER_GPU\n", ["`distributed_type`", "'SUPER_GPU'", "MULTI_GPU"]),
        ("distributed_type: NO\nnum_processes: two\n", ["`num_processes`", "'two'", "number"]),
        ("distributed_type: NO\nmixed_precision: fp32\n", ["`mixed_precision`", "'fp32'", "bf16"]),
        ("distributed_type: NO\nuse_cpu: maybe\n", ["`use_cpu`", "'maybe'", "true or false"]),
        ("distributed_type: NO\nfsdp_config:\n  fsdp_shardng_strategy: FULL_SHARD\n", ["fsdp_config", "did you mean `fsdp_sharding_strategy`"]),
        ("distributed_type: FSDP\nfsdp_config:\n  fsdp_cpu_ram_efficient_loading: true\n  fsdp_sync_module_states: false\n", ["fsdp_sync_module_states", "fsdp_cpu_ram_efficient_loading", "Set"]),
        ("distributed_type: NO\ndeepspeed_config:\n  zero_stage: 5\n", ["deepspeed_config.zero_stage", "5"]),
        ("distributed_type: MULTI_GPU\nnum_machines: 2\nmachine_rank: 2\n", ["machine_rank", "0 to 1"]),
        ("distributed_type: MULTI_GPU\nnum_processes: 0\n", ["num_processes is 0"]),
        ("distributed_type: NO\ngpu_ids: first\n", ["`gpu_ids`", "'first'", "comma-separated"]),
        ("mixed_precision: fp16\n", ["no `distributed_type`"]),
        ("- a\n- b\n", ["list at the top level"]),
        ("", ["is empty"]),
        ("distributed_type: [NO\n", ["not valid YAML", "line"]),
        ("compute_environment: AMAZON_SAGEMAKER\ndistributed_type: DATA_PARALLEL\n", ["`ec2_instance_type` is required", "`iam_role_name` is required"]),
        ("distributed_type: NO\nipex_config: {ipex: true}\n", ["ipex_config", "config update"]),
    ],
)
def test_bad_input_gives_one_paragraph_naming_file_field_and_fix(tmp_path, text, expected):
    path = write(tmp_path / "bad.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_config_path(path)
    message = info.value.message
    assert str(path) in message
    assert "\n" not in message
    for part in expected:
        assert part.lower() in message.lower(), (part, message)


def test_broken_json_names_line_and_column(tmp_path):
    path = write(tmp_path / "bad.json", '{"distributed_type": "NO",\n "num_processes": }')
    with pytest.raises(ConfigError, match=r"not valid JSON: .* line 2, column"):
        load_config_path(path)


def test_binary_and_missing_files_are_clear_errors(tmp_path):
    binary = tmp_path / "c.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_raw(binary)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config_path(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is a folder"):
        read_raw(tmp_path)


def test_default_path_is_resolved_at_call_time(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "a"))
    assert default_config_path() == tmp_path / "a" / "accelerate" / "default_config.yaml"
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_cache_home() == tmp_path / "xdg" / "huggingface"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_config_path() == tmp_path / "home" / ".cache" / "huggingface" / "accelerate" / "default_config.yaml"


def test_legacy_json_default_is_found_when_no_yaml_exists(hf_home):
    folder = hf_home / "accelerate"
    folder.mkdir(parents=True)
    (folder / "default_config.json").write_text(json.dumps({"distributed_type": "NO", "mixed_precision": "bf16"}))
    loaded = load_config_file(None)
    assert loaded.location.source == "legacy-default"
    assert loaded.config.mixed_precision == "bf16"
    assert "legacy default" in loaded.location.describe()
    (folder / "default_config.yaml").write_text("distributed_type: MULTI_CPU\nnum_processes: 2\n")
    assert find_default_config().source == "default"
    assert load_config_file(None).config.distributed_type == "MULTI_CPU"


def test_no_default_config_says_where_it_looked(hf_home):
    assert load_config_file(None, required=False) is None
    with pytest.raises(ConfigError) as info:
        load_config_file(None)
    assert str(hf_home / "accelerate" / "default_config.yaml") in info.value.message
    assert "default_config.json" in info.value.message


def test_flags_written_as_words_keep_their_meaning():
    config = load_config_path(SAMPLES / "era2_downcast_text.yaml").config
    assert config.downcast_bf16 == "no"
    assert as_bool(config.downcast_bf16) is False
    assert as_bool("YES") is True
    with pytest.raises(ValueError):
        as_bool("perhaps")


def test_results_survive_a_json_round_trip_as_prefect_persists_them():
    for name in ["fsdp1_current.yaml", "era3_dynamo_backend.yaml", "fp8_questionnaire_keys.yaml", "sagemaker_unquoted.yaml"]:
        loaded = load_config_path(SAMPLES / name)
        again = type(loaded).model_validate_json(loaded.model_dump_json())
        assert again.config.to_dict() == loaded.config.to_dict(), name
