"""A real sharded checkpoint: two FSDP2 ranks on CPU (gloo), launched through our launcher, saved with DCP
(plus the same weights saved through FSDP1 as ShardedTensors, Accelerate's default fsdp_version).

Merged, every tensor must equal the full model state the job gathered; the files must match what
Accelerate's own `merge_fsdp_weights` writes from the same checkpoint; the CLI must behave in a subprocess.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from prefect_accelerate.errors import MergeError
from prefect_accelerate.merge import merge_weights

pytestmark = pytest.mark.slow  # the checkpoint comes from a two-process launch

SCRIPTS = Path(__file__).resolve().parent / "scripts"
CLI = [str(Path(sys.executable).with_name("prefect-accelerate"))]  # the installed console script


def full_state(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "full_state.pt", weights_only=True)


def assert_same_state(merged: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(merged) == sorted(expected)
    for name, tensor in expected.items():
        assert merged[name].dtype == tensor.dtype and merged[name].shape == tensor.shape, name
        assert torch.equal(merged[name], tensor), name


def test_the_checkpoint_is_really_sharded_over_two_ranks(fsdp_run):
    info = json.loads((fsdp_run / "info.json").read_text())
    assert info["world_size"] == 2 and info["sharding"] == "fully_shard"
    assert "head.weight" in info["dtensor_keys"] and "embed.weight" in info["dtensor_keys"]
    assert sorted(p.name for p in (fsdp_run / "pytorch_model_fsdp_0").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_merged_safetensors_equal_the_full_model_state(fsdp_checkpoint, tmp_path):
    result = merge_weights(fsdp_checkpoint / "pytorch_model_fsdp_0", tmp_path / "out")
    merged = load_file(tmp_path / "out" / "model.safetensors")
    assert_same_state(merged, full_state(fsdp_checkpoint))
    assert "scratch" not in merged  # the non-persistent buffer
    assert result.unwrapped_key == "model" and {t.dtype for t in result.tensors} == {"float32", "int64", "bfloat16"}
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as file:
        assert file.metadata() == {"format": "pt"}


def test_merged_bin_equals_the_full_model_state(fsdp_checkpoint, tmp_path):
    merge_weights(fsdp_checkpoint / "pytorch_model_fsdp_0", tmp_path / "out", unsafe_serialization=True)
    assert_same_state(torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True), full_state(fsdp_checkpoint))


def test_output_matches_accelerates_merge_fsdp_weights_on_the_same_checkpoint(fsdp_checkpoint, tmp_path):
    from accelerate.utils import merge_fsdp_weights

    folder = fsdp_checkpoint / "pytorch_model_fsdp_0"
    merge_fsdp_weights(str(folder), str(tmp_path / "accelerate"))
    merge_fsdp_weights(str(folder), str(tmp_path / "accelerate"), safe_serialization=False)
    merge_weights(folder, tmp_path / "ours")
    merge_weights(folder, tmp_path / "ours", unsafe_serialization=True)
    assert (tmp_path / "ours" / "model.safetensors").read_bytes() == (tmp_path / "accelerate" / "model.safetensors").read_bytes()
    theirs = torch.load(tmp_path / "accelerate" / "pytorch_model.bin", weights_only=True)
    ours = torch.load(tmp_path / "ours" / "pytorch_model.bin", weights_only=True)
    assert list(ours) == list(theirs)
    assert_same_state(ours, theirs)


def test_an_fsdp1_sharded_tensor_checkpoint_merges_to_the_same_weights(fsdp_run, tmp_path):
    from accelerate.utils import merge_fsdp_weights

    info = json.loads((fsdp_run / "info.json").read_text())
    assert "head.weight" in info["fsdp1_sharded_tensor_keys"]
    folder = fsdp_run.parent / "fsdp1" / "pytorch_model_fsdp_0"
    merge_weights(folder, tmp_path / "ours")
    assert_same_state(load_file(tmp_path / "ours" / "model.safetensors"), full_state(fsdp_run))
    merge_fsdp_weights(str(folder), str(tmp_path / "accelerate"))
    assert (tmp_path / "ours" / "model.safetensors").read_bytes() == (tmp_path / "accelerate" / "model.safetensors").read_bytes()


def test_sharded_output_loads_into_the_model_through_its_index(fsdp_checkpoint, tmp_path):
    from huggingface_hub import load_torch_model

    result = merge_weights(fsdp_checkpoint / "pytorch_model_fsdp_0", tmp_path / "out", max_shard_size="2KB")
    shards = [f for f in result.files if f != result.index_file]
    assert len(shards) >= 3 and result.index_file == "model.safetensors.index.json"
    for shard in shards:
        tensors = [t for t in result.tensors if t.file == shard]
        assert sum(t.nbytes for t in tensors) <= 2000 or len(tensors) == 1

    spec = importlib.util.spec_from_file_location("make_checkpoint", SCRIPTS / "make_checkpoint.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model = script.TinyModel(hidden=16, layers=2)
    load_torch_model(model, tmp_path / "out", strict=True)
    assert_same_state(model.state_dict(), full_state(fsdp_checkpoint))


def test_the_optimizer_folder_is_refused_and_the_model_folder_named(fsdp_checkpoint, tmp_path):
    with pytest.raises(MergeError, match=f"Pass the model folder saved beside it: {fsdp_checkpoint / 'pytorch_model_fsdp_0'}"):
        merge_weights(fsdp_checkpoint / "optimizer_0", tmp_path / "out")


def test_the_optimizer_folder_with_unsafe_serialization_matches_accelerate(fsdp_checkpoint, tmp_path):
    from accelerate.utils import merge_fsdp_weights

    merge_fsdp_weights(str(fsdp_checkpoint / "optimizer_0"), str(tmp_path / "accelerate"), safe_serialization=False)
    result = merge_weights(fsdp_checkpoint / "optimizer_0", tmp_path / "ours", unsafe_serialization=True)
    theirs = torch.load(tmp_path / "accelerate" / "pytorch_model.bin", weights_only=False)
    ours = torch.load(tmp_path / "ours" / "pytorch_model.bin", weights_only=False)
    assert result.optimizer_state and list(ours) == ["state", "param_groups"]
    assert_same_nested(ours, theirs)
    assert sorted(ours["state"]) == json.loads((fsdp_checkpoint / "info.json").read_text())["dtensor_keys"]  # the parameters


def assert_same_nested(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    if isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs)
        for key in theirs:
            assert_same_nested(ours[key], theirs[key])
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert_same_nested(a, b)
    else:
        assert ours == theirs


def test_the_save_state_folder_itself_names_pytorch_model_fsdp_0(fsdp_checkpoint, tmp_path):
    with pytest.raises(MergeError, match=f"Pass the model weights folder instead: {fsdp_checkpoint / 'pytorch_model_fsdp_0'}"):
        merge_weights(fsdp_checkpoint, tmp_path / "out")


def test_remove_checkpoint_dir_removes_only_the_model_folder(fsdp_checkpoint, tmp_path):
    expected = full_state(fsdp_checkpoint)
    result = merge_weights(fsdp_checkpoint / "pytorch_model_fsdp_0", tmp_path / "out", remove_checkpoint_dir=True)
    assert result.checkpoint_removed and not (fsdp_checkpoint / "pytorch_model_fsdp_0").exists()
    assert (fsdp_checkpoint / "optimizer_0" / ".metadata").exists()
    assert_same_state(load_file(tmp_path / "out" / "model.safetensors"), expected)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_ACCELERATE_TRACK": "never"}
    return subprocess.run([*CLI, "merge-weights", *args], capture_output=True, text=True, timeout=120, env=env)


def test_cli_merges_with_every_flag(fsdp_checkpoint, tmp_path):
    out = tmp_path / "nested" / "out"
    done = run_cli(str(fsdp_checkpoint / "pytorch_model_fsdp_0"), str(out), "--unsafe-serialization",
                   "--max_shard_size", "4KB", "--remove_checkpoint_dir")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Merged 17 tensors") and "Removed the checkpoint folder" in done.stdout
    assert (out / "pytorch_model.bin.index.json").exists() and not (fsdp_checkpoint / "pytorch_model_fsdp_0").exists()


@pytest.mark.parametrize("case", ["parent", "optimizer", "missing", "bad_size"])  # the rest are tested in-process
def test_cli_errors_exit_2_with_one_paragraph_and_no_traceback(fsdp_checkpoint, tmp_path, case):
    args = {
        "parent": [str(fsdp_checkpoint), str(tmp_path / "out")],
        "optimizer": [str(fsdp_checkpoint / "optimizer_0"), str(tmp_path / "out")],
        "missing": [str(tmp_path / "nope"), str(tmp_path / "out")],
        "bad_size": [str(fsdp_checkpoint / "pytorch_model_fsdp_0"), str(tmp_path / "out"), "--max_shard_size", "lots"],
    }[case]
    done = run_cli(*args)
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert not (tmp_path / "out").exists()
