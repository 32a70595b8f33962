"""Bad inputs: each gets a MergeError that says what was found and what to pass, and nothing is written."""

from __future__ import annotations

import pickle

import pytest
import torch

from prefect_accelerate.errors import MergeError, UsageError
from prefect_accelerate.merge import merge_weights


def merge_error(checkpoint, output, **kwargs) -> str:
    with pytest.raises(MergeError) as caught:
        merge_weights(checkpoint, output, **kwargs)
    assert caught.value.exit_code == 2
    message = caught.value.message
    assert "\n" not in message and "Traceback" not in message
    return message


def test_missing_folder_is_named_with_the_checkpoint_folders_near_it(make_checkpoint, tmp_path):
    folder = make_checkpoint()
    message = merge_error(folder.parent / "pytorch_model_fsdp_1", tmp_path / "out")
    assert "pytorch_model_fsdp_1 does not exist" in message
    assert "Did you mean `pytorch_model_fsdp_0`?" in message
    assert not (tmp_path / "out").exists()


def test_missing_folder_in_an_empty_parent_says_so(tmp_path):
    message = merge_error(tmp_path / "nothing", tmp_path / "out")
    assert "does not exist" in message and "holds no distributed checkpoint folder" in message


def test_parent_of_pytorch_model_fsdp_0_names_the_subfolder_to_pass(make_checkpoint, tmp_path):
    folder = make_checkpoint()
    message = merge_error(folder.parent, tmp_path / "out")
    assert "has no `.metadata` file" in message
    assert f"Pass the model weights folder instead: {folder}" in message


def test_two_levels_above_with_model_and_optimizer_folders_names_the_model_one(make_checkpoint, tmp_path):
    model = make_checkpoint(where="checkpoints/checkpoint_3")
    make_checkpoint({"state": {"w": {"exp_avg": torch.zeros(2)}}, "param_groups": [{"lr": 0.1, "params": ["w"]}]},
                    wrap="optimizer", where="checkpoints/checkpoint_3/x")
    (model.parent / "x" / "pytorch_model_fsdp_0").rename(model.parent / "optimizer_0")
    message = merge_error(tmp_path / "checkpoints", tmp_path / "out")
    assert f"Pass the model weights folder instead: {model}" in message
    assert "optimizer_0" in message


def test_folder_without_metadata_lists_what_it_holds(tmp_path):
    folder = tmp_path / "junk"
    folder.mkdir()
    (folder / "notes.txt").write_text("hi")
    (folder / "logs").mkdir()
    message = merge_error(folder, tmp_path / "out")
    assert "It contains logs/, notes.txt" in message and "pytorch_model_fsdp_<i>" in message


def test_empty_folder_says_it_is_empty(tmp_path):
    (tmp_path / "empty").mkdir()
    assert "The folder is empty" in merge_error(tmp_path / "empty", tmp_path / "out")


def test_distcp_files_without_metadata_explain_the_interrupted_save_or_copy(make_checkpoint, tmp_path):
    folder = make_checkpoint()
    (folder / ".metadata").unlink()
    message = merge_error(folder, tmp_path / "out")
    assert "1 `*.distcp` shard file(s)" in message and "interrupted" in message and "cp -r folder/*" in message


def test_optimizer_folder_is_refused_and_the_model_folder_beside_it_named(make_checkpoint, tmp_path):
    model = make_checkpoint()
    optimizer = model.parent / "optimizer_0"
    make_checkpoint({"state": {"embed.weight": {"exp_avg": torch.zeros(2), "step": torch.tensor(1.0)}},
                     "param_groups": [{"lr": 0.1, "params": ["embed.weight"]}]}, wrap="optimizer", where="opt")
    (tmp_path / "opt" / "pytorch_model_fsdp_0").rename(optimizer)
    message = merge_error(optimizer, tmp_path / "out")
    assert "holds optimizer state" in message and f"Pass the model folder saved beside it: {model}." in message
    assert "--unsafe_serialization" in message
    assert not (tmp_path / "out").exists()


def test_optimizer_state_with_unsafe_serialization_is_one_nested_state_dict_like_accelerates(make_checkpoint, tmp_path):
    optimizer = {"state": {"w": {"exp_avg": torch.full((3,), 2.0), "step": torch.tensor(4.0)}},
                 "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}]}
    folder = make_checkpoint(optimizer, wrap="optimizer", where="opt")
    result = merge_weights(folder, tmp_path / "out", unsafe_serialization=True, max_shard_size=1)  # never sharded
    merged = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=False)
    assert result.optimizer_state and result.files == ["pytorch_model.bin"]
    assert merged["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}]
    assert torch.equal(merged["state"]["w"]["exp_avg"], torch.full((3,), 2.0)) and merged["state"]["w"]["step"] == 4.0
    assert result.message().startswith("Merged optimizer state: 2 tensors")


def test_file_inside_a_checkpoint_points_to_its_folder(make_checkpoint, tmp_path):
    folder = make_checkpoint()
    message = merge_error(folder / ".metadata", tmp_path / "out")
    assert f"pass the folder that holds it instead: {folder}" in message


def test_already_merged_weights_are_recognised(make_checkpoint, tmp_path):
    folder = make_checkpoint()
    merge_weights(folder, tmp_path / "merged")
    assert "already a merged weights file" in merge_error(tmp_path / "merged" / "model.safetensors", tmp_path / "out")
    assert "already merged weights (model.safetensors)" in merge_error(tmp_path / "merged", tmp_path / "out")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "not_metadata"])
def test_corrupt_metadata_is_reported_with_the_file_and_a_fix(make_checkpoint, tmp_path, damage):
    folder = make_checkpoint()
    metadata = folder / ".metadata"
    if damage == "garbage":
        metadata.write_bytes(b"\x00\x01 not a pickle")
    elif damage == "truncated":
        metadata.write_bytes(metadata.read_bytes()[:40])
    else:
        metadata.write_bytes(pickle.dumps({"a": 1}))
    message = merge_error(folder, tmp_path / "out")
    assert str(metadata) in message
    assert ("damaged" in message) or ("not a torch Distributed Checkpoint" in message)
    assert not (tmp_path / "out").exists()


def test_truncated_shard_file_is_found_before_anything_is_written(make_checkpoint, tmp_path):
    folder = make_checkpoint()
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    message = merge_error(folder, tmp_path / "out" / "deep")
    assert f"{shard.name} has 100 bytes where" in message and "truncated" in message
    assert not (tmp_path / "out").exists()


def test_missing_shard_file_is_named(make_checkpoint, tmp_path):
    folder = make_checkpoint()
    shard = next(folder.glob("*.distcp"))
    shard.unlink()
    assert f"{shard.name} is missing" in merge_error(folder, tmp_path / "out")


def test_damaged_shard_bytes_fail_the_read_and_leave_no_output(make_checkpoint, tmp_path):
    folder = make_checkpoint()
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(b"\x00" * shard.stat().st_size)  # right length, wrong content
    message = merge_error(folder, tmp_path / "a" / "b")
    assert "do not hold what `.metadata` describes" in message
    assert not (tmp_path / "a").exists()


def test_output_path_that_is_a_file_is_refused(make_checkpoint, tmp_path):
    target = tmp_path / "weights.safetensors"
    target.write_text("keep me")
    assert "is a file" in merge_error(make_checkpoint(), target)
    assert target.read_text() == "keep me"


def test_output_below_a_file_is_refused(make_checkpoint, tmp_path):
    (tmp_path / "plain").write_text("x")
    assert "plain is a file" in merge_error(make_checkpoint(), tmp_path / "plain" / "out")


def test_output_inside_the_checkpoint_is_refused_with_remove(make_checkpoint):
    folder = make_checkpoint()
    message = merge_error(folder, folder / "merged", remove_checkpoint_dir=True)
    assert "inside the checkpoint folder" in message
    assert (folder / ".metadata").exists() and not (folder / "merged").exists()


def test_remove_is_refused_when_the_folder_holds_other_files(make_checkpoint, tmp_path):
    folder = make_checkpoint()
    (folder / "README.md").write_text("my notes")
    message = merge_error(folder, tmp_path / "out", remove_checkpoint_dir=True)
    assert "Refusing --remove_checkpoint_dir" in message and "README.md" in message
    assert (folder / "README.md").exists() and not (tmp_path / "out").exists()


def test_non_tensor_entries_need_unsafe_serialization(make_checkpoint, tmp_path):
    folder = make_checkpoint({"weight": torch.ones(2), "config": {"hidden": 8}, "name": "tiny"})
    message = merge_error(folder, tmp_path / "out")
    assert "non-tensor entries" in message and "--unsafe_serialization" in message
    result = merge_weights(folder, tmp_path / "out", unsafe_serialization=True)
    loaded = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=False)  # nested as saved, as Accelerate
    assert loaded["config"] == {"hidden": 8} and loaded["name"] == "tiny" and torch.equal(loaded["weight"], torch.ones(2))
    assert sorted(result.objects) == ["config.hidden", "name"]


@pytest.mark.parametrize("size", ["5 parsecs", "GB", "-1", "0"])
def test_unreadable_max_shard_size_is_a_usage_error(make_checkpoint, tmp_path, size):
    with pytest.raises(UsageError, match="--max_shard_size"):
        merge_weights(make_checkpoint(), tmp_path / "out", max_shard_size=size)
    assert not (tmp_path / "out").exists()


def test_too_little_disk_space_is_reported_before_writing(make_checkpoint, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9, 10))
    message = merge_error(make_checkpoint(), tmp_path / "new" / "out")
    assert "free" in message and "another disk" in message
    assert not (tmp_path / "new").exists()
