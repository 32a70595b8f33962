"""Both directions against Accelerate 1.16.0 itself (a test-only dependency).

Files we read or write must mean the same to Accelerate's own loader, and `config update` must give
Accelerate's result apart from the differences listed in docs/compatibility.md.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest
import yaml

pytest.importorskip("accelerate")
from accelerate.commands.config.config_args import ClusterConfig as AccClusterConfig  # noqa: E402
from accelerate.commands.config.config_args import load_config_from_file  # noqa: E402
from accelerate.commands.config.default import write_basic_config  # noqa: E402
from accelerate.commands.config.update import update_config  # noqa: E402

from prefect_accelerate.config.defaults import write_default_config  # noqa: E402
from prefect_accelerate.config.io import load_config_path, save_config_file  # noqa: E402
from prefect_accelerate.config.update import update_config_file  # noqa: E402

SAMPLES = Path(__file__).resolve().parent.parent / "fixtures" / "configs"
ALL = sorted(p.name for p in SAMPLES.iterdir() if p.suffix in (".yaml", ".json"))
#: samples where Accelerate deliberately differs (docs/compatibility.md): unquoted NO; removed ipex_config
DIFFERENT = {"sagemaker_unquoted.yaml", "ipex_legacy.yaml"}


def plain(data: dict) -> dict:
    return {k: (v.value if hasattr(v, "value") else v) for k, v in data.items()}


@pytest.mark.parametrize("name", [n for n in ALL if n not in DIFFERENT])
def test_samples_load_to_the_same_values_as_in_accelerate(name):
    ours = load_config_path(SAMPLES / name).config.to_dict()
    theirs = plain(load_config_from_file(str(SAMPLES / name)).to_dict())
    assert ours == theirs


@pytest.mark.parametrize("name", [n for n in ALL if n not in DIFFERENT])
def test_config_update_gives_accelerates_result_byte_for_byte(name, tmp_path):
    ours_path = Path(shutil.copy(SAMPLES / name, tmp_path / f"ours-{name}"))
    theirs_path = Path(shutil.copy(SAMPLES / name, tmp_path / f"theirs-{name}"))
    update_config_file(ours_path)
    update_config(argparse.Namespace(config_file=str(theirs_path)))
    assert ours_path.read_text() == theirs_path.read_text()


def test_unquoted_no_is_a_listed_difference():
    ours = load_config_path(SAMPLES / "sagemaker_unquoted.yaml").config.to_dict()
    theirs = plain(load_config_from_file(str(SAMPLES / "sagemaker_unquoted.yaml")).to_dict())
    assert ours["distributed_type"] == "NO" and theirs["distributed_type"] is False
    assert {k: v for k, v in ours.items() if k != "distributed_type"} == {k: v for k, v in theirs.items() if k != "distributed_type"}


def test_removed_ipex_section_is_dropped_by_update_where_accelerate_refuses(tmp_path):
    path = Path(shutil.copy(SAMPLES / "ipex_legacy.yaml", tmp_path / "c.yaml"))
    with pytest.raises(ValueError, match="unknown keys"):
        load_config_from_file(str(path))
    update_config_file(path)
    assert plain(load_config_from_file(str(path)).to_dict()) == load_config_path(path).config.to_dict()


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_files_we_write_load_in_accelerate_with_the_same_values(tmp_path, suffix):
    default = write_default_config(tmp_path / f"default{suffix}", "bf16").path
    assert plain(load_config_from_file(str(default)).to_dict()) == load_config_path(default).config.to_dict()
    for name in ["fsdp2_parallelism.yaml", "deepspeed_zero3_multinode.yaml", "fp8_cli_keys.yaml", "megatron.yaml"]:
        target = tmp_path / f"{Path(name).stem}{suffix}"
        save_config_file(load_config_path(SAMPLES / name).config, target)
        assert plain(load_config_from_file(str(target)).to_dict()) == load_config_path(target).config.to_dict(), name


def test_files_accelerate_writes_load_in_ours_with_the_same_values(tmp_path):
    basic = tmp_path / "basic.yaml"
    write_basic_config("fp16", str(basic))
    assert load_config_path(basic).config.to_dict() == plain(load_config_from_file(str(basic)).to_dict())
    rich = AccClusterConfig(
        compute_environment="LOCAL_MACHINE", distributed_type="FSDP", mixed_precision="bf16", use_cpu=False, debug=True,
        num_processes=4, gpu_ids="0,1,2,3", main_process_port=29501, enable_cpu_affinity=True,
        fsdp_config={"fsdp_version": 2, "fsdp_reshard_after_forward": False, "fsdp_auto_wrap_policy": "NO_WRAP", "fsdp_offload_params": True},
        dynamo_config={"dynamo_backend": "INDUCTOR", "dynamo_mode": "max-autotune", "dynamo_use_fullgraph": True},
        fp8_config={"backend": "AO", "enable_fsdp_float8_all_gather": True, "pad_inner_dim": False},
        parallelism_config={"parallelism_config_tp_size": 2, "parallelism_config_dp_shard_size": 2},
    )
    for name, writer in [("rich.yaml", rich.to_yaml_file), ("rich.json", rich.to_json_file)]:
        writer(str(tmp_path / name))
        ours = load_config_path(tmp_path / name).config.to_dict()
        assert ours == plain(load_config_from_file(str(tmp_path / name)).to_dict())
        assert yaml.safe_load((tmp_path / name).read_text()) == ours
