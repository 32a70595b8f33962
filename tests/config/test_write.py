"""`config default`, `config update` and `to-fsdp2`: what they write, backups, refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from prefect_accelerate.config.defaults import build_default_config, write_default_config
from prefect_accelerate.config.fsdp2 import convert_fsdp_section, convert_to_fsdp2
from prefect_accelerate.config.io import load_config_path, write_text_atomic
from prefect_accelerate.config.update import update_config_file
from prefect_accelerate.envreport.devices import AcceleratorInfo, Device
from prefect_accelerate.errors import ConfigError

SAMPLES = Path(__file__).resolve().parent.parent / "fixtures" / "configs"
CPU = AcceleratorInfo(None, ())
TWO_GPUS = AcceleratorInfo("cuda", (Device(0, "A100", 80 << 30), Device(1, "A100", 80 << 30)))


def copy_sample(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copy(SAMPLES / name, tmp_path / name))


def test_default_config_on_a_cpu_host_matches_accelerates_fields():
    config = build_default_config("bf16", CPU)
    assert config.to_dict() == {
        "compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": "NO", "downcast_bf16": False,
        "enable_cpu_affinity": False, "machine_rank": 0, "main_training_function": "main", "mixed_precision": "bf16",
        "num_machines": 1, "num_processes": 1, "rdzv_backend": "static", "same_network": False,
        "tpu_use_cluster": False, "tpu_use_sudo": False, "use_cpu": True,
    }


def test_default_config_for_several_gpus_is_multi_gpu():
    config = build_default_config("fp16", TWO_GPUS)
    assert (config.distributed_type, config.num_processes, config.use_cpu) == ("MULTI_GPU", 2, False)
    one = build_default_config("no", AcceleratorInfo("xpu", (Device(0, "Max", None),)))
    assert (one.distributed_type, one.num_processes) == ("NO", 1)
    mlu = build_default_config("no", AcceleratorInfo("mlu", (Device(0, "x", None), Device(1, "x", None))))
    assert mlu.distributed_type == "MULTI_MLU" and mlu.use_cpu is False


def test_default_writes_yaml_to_yaml_and_json_to_json(tmp_path):
    write_default_config(tmp_path / "a.yaml", accelerator=CPU)
    assert yaml.safe_load((tmp_path / "a.yaml").read_text())["distributed_type"] == "NO"
    assert not (tmp_path / "a.yaml").read_text().lstrip().startswith("{")
    write_default_config(tmp_path / "b.json", accelerator=CPU)
    assert json.loads((tmp_path / "b.json").read_text())["use_cpu"] is True


def test_default_refuses_to_overwrite_without_force_and_keeps_a_backup_with_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("distributed_type: MULTI_CPU\nnum_processes: 4\n")
    result = write_default_config(path, accelerator=CPU)
    assert not result.written and "--force" in result.message()
    assert "MULTI_CPU" in path.read_text()
    forced = write_default_config(path, "fp16", force=True, accelerator=CPU)
    assert forced.written and forced.backup == tmp_path / "c.yaml.bak"
    assert "MULTI_CPU" in forced.backup.read_text()
    assert load_config_path(path).config.mixed_precision == "fp16"


def test_default_goes_to_the_default_path_and_creates_folders(hf_home):
    result = write_default_config(accelerator=CPU)
    assert result.path == hf_home / "accelerate" / "default_config.yaml" and result.path.exists()


def test_update_migrates_keeps_backup_and_second_run_changes_nothing(tmp_path):
    path = copy_sample("era1_fp16_flag.yaml", tmp_path)
    original = path.read_text()
    result = update_config_file(path)
    assert result.written
    assert (tmp_path / "era1_fp16_flag.yaml.bak").read_text() == original
    text = "\n".join(result.changes)
    for expected in ["mixed_precision", "dropped deepspeed_config (it was empty)", "dropped main_process_ip (it was null)", "added rdzv_backend: 'static'"]:
        assert expected in text
    data = yaml.safe_load(path.read_text())
    assert data["mixed_precision"] == "fp16" and "fp16" not in data and "deepspeed_config" not in data
    again = update_config_file(path)
    assert not again.written and "already up to date" in again.message()
    assert (tmp_path / "era1_fp16_flag.yaml.bak").read_text() == original


def test_update_keeps_json_files_json(tmp_path):
    path = copy_sample("multinode_c10d.json", tmp_path)
    update_config_file(path)
    assert json.loads(path.read_text())["rdzv_backend"] == "c10d"


def test_update_drops_removed_sections_and_says_why(tmp_path):
    path = copy_sample("ipex_legacy.yaml", tmp_path)
    result = update_config_file(path)
    assert any("ipex_config" in change and "1.13" in change for change in result.changes)
    assert "ipex_config" not in path.read_text()


def test_update_without_any_file_says_where_it_looked(hf_home):
    with pytest.raises(ConfigError) as info:
        update_config_file(None)
    assert str(hf_home / "accelerate" / "default_config.yaml") in info.value.message


def test_update_of_the_default_file(hf_home):
    folder = hf_home / "accelerate"
    folder.mkdir(parents=True)
    (folder / "default_config.yaml").write_text("distributed_type: NO\nfp16: true\n")
    result = update_config_file()
    assert result.location.source == "default" and result.config.mixed_precision == "fp16"


def test_a_failed_update_leaves_the_file_untouched(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("distributed_type: NO\nnum_processes: many\n")
    before = path.read_bytes()
    with pytest.raises(ConfigError):
        update_config_file(path)
    assert path.read_bytes() == before and not (tmp_path / "bad.yaml.bak").exists()


def test_atomic_write_keeps_permissions_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("old\n")
    path.chmod(0o640)
    write_text_atomic(path, "new\n")
    assert path.read_text() == "new\n" and (path.stat().st_mode & 0o777) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "c.yaml.bak"]


def test_to_fsdp2_maps_keys_like_accelerate(tmp_path):
    out = tmp_path / "v2.yaml"
    result = convert_to_fsdp2(SAMPLES / "fsdp1_current.yaml", out)
    fsdp = yaml.safe_load(out.read_text())["fsdp_config"]
    assert fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_reshard_after_forward"] is True  # HYBRID_SHARD
    for gone in ["fsdp_backward_prefetch", "fsdp_sync_module_states", "fsdp_use_orig_params", "fsdp_forward_prefetch", "fsdp_sharding_strategy"]:
        assert gone not in fsdp
    assert fsdp["fsdp_ignored_modules"] is None and fsdp["fsdp_transformer_layer_cls_to_wrap"] == "GPT2Block"
    assert len(result.notes) == 4
    assert load_config_path(out).config.fsdp_config.fsdp_version == 2


def test_to_fsdp2_value_map_and_later_key_wins():
    section, _ = convert_fsdp_section({"fsdp_sharding_strategy": "FULL_SHARD", "fsdp_reshard_after_forward": "SHARD_GRAD_OP"})
    assert section == {"fsdp_reshard_after_forward": False, "fsdp_version": 2}
    section, _ = convert_fsdp_section({"sharding_strategy": 5})
    assert section["fsdp_reshard_after_forward"] is False  # 5 = HYBRID_SHARD_ZERO2


def test_to_fsdp2_checks_arguments_like_accelerate(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        convert_to_fsdp2(tmp_path / "missing.yaml", tmp_path / "o.yaml")
    source = copy_sample("fsdp1_current.yaml", tmp_path)
    with pytest.raises(ConfigError, match="--output_file"):
        convert_to_fsdp2(source)
    existing = tmp_path / "exists.yaml"
    existing.write_text("x: 1\n")
    with pytest.raises(ConfigError, match="already exists"):
        convert_to_fsdp2(source, existing)
    assert existing.read_text() == "x: 1\n"


def test_to_fsdp2_in_place_keeps_a_backup_and_skips_fsdp2_configs(tmp_path):
    source = copy_sample("fsdp1_current.yaml", tmp_path)
    convert_to_fsdp2(source, overwrite=True)
    assert (tmp_path / "fsdp1_current.yaml.bak").exists()
    again = convert_to_fsdp2(source, overwrite=True)
    assert any("already specifies FSDP2" in note for note in again.notes)
    plain = convert_to_fsdp2(copy_sample("current_single.yaml", tmp_path), tmp_path / "o.yaml")
    assert any("no fsdp_config" in note for note in plain.notes)
