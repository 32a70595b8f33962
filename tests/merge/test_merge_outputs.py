"""What a merge writes: both formats, shards with an index, atomic publishing, verification, removal, progress."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import zipfile

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from prefect_accelerate.errors import MergeError
from prefect_accelerate.merge import MergeProgress, StderrProgress, merge_weights, parse_size
from prefect_accelerate.merge import core as merge_core
from prefect_accelerate.merge.safetensors_file import SafetensorsWriter


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN == NaN, -0.0 != 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".merge-weights-")) if folder.exists() else []


def test_safetensors_output_holds_every_tensor_unchanged_under_unwrapped_names(make_checkpoint, tmp_path, sample_state):
    state = sample_state
    result = merge_weights(make_checkpoint(state), tmp_path / "out")
    merged = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(merged) == sorted(state) and all(same_bits(merged[k], state[k]) for k in state)
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as file:
        assert file.metadata() == {"format": "pt"}
    assert result.unwrapped_key == "model" and result.files == ["model.safetensors"] and result.index_file is None
    assert result.total_bytes == sum(t.numel() * t.element_size() for t in state.values())
    assert {t.name: t.shape for t in result.tensors}["embed.weight"] == [11, 8]
    assert leftovers(tmp_path / "out") == []


def test_safetensors_file_is_byte_identical_to_the_safetensors_library(make_checkpoint, tmp_path, sample_state):
    state = sample_state | {
        f"extra.{dtype}": torch.arange(6).to(getattr(torch, dtype))
        for dtype in ("uint8", "int8", "int16", "uint16", "uint32", "uint64", "complex64", "float8_e4m3fn", "float8_e5m2")
    }
    merge_weights(make_checkpoint(state), tmp_path / "out", read_group_bytes=1)  # one tensor per read
    save_file(state, tmp_path / "reference.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()


def test_bin_output_loads_with_weights_only(make_checkpoint, tmp_path, sample_state):
    state = sample_state
    result = merge_weights(make_checkpoint(state), tmp_path / "out", unsafe_serialization=True)
    merged = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert sorted(merged) == sorted(state) and all(same_bits(merged[k], state[k]) for k in state)
    assert result.format == "bin" and result.files == ["pytorch_model.bin"]


def test_output_folder_and_its_parents_are_created(make_checkpoint, tmp_path):
    merge_weights(make_checkpoint(), tmp_path / "a" / "b" / "c")
    assert (tmp_path / "a" / "b" / "c" / "model.safetensors").is_file()


def test_checkpoint_without_a_single_top_level_key_keeps_its_names(make_checkpoint, tmp_path):
    folder = make_checkpoint({"encoder": {"w": torch.ones(2)}, "decoder": {"w": torch.zeros(2)}}, wrap=None)
    result = merge_weights(folder, tmp_path / "out")
    assert result.unwrapped_key is None
    assert sorted(load_file(tmp_path / "out" / "model.safetensors")) == ["decoder.w", "encoder.w"]


def test_a_lone_top_level_tensor_is_not_unwrapped(make_checkpoint, tmp_path):
    merge_weights(make_checkpoint({"weight": torch.ones(3)}, wrap=None), tmp_path / "out")
    assert list(load_file(tmp_path / "out" / "model.safetensors")) == ["weight"]


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_large_checkpoints_are_sharded_like_huggingface_hub_with_an_index(make_checkpoint, tmp_path, fmt):
    from huggingface_hub import split_torch_state_dict_into_shards

    state = {f"layers.{i}.weight": torch.full((50 + 30 * (i % 3),), float(i)) for i in range(12)}  # 200-520 bytes each
    state["big"] = torch.zeros(400)  # 1600 bytes: above the limit, a shard of its own
    result = merge_weights(make_checkpoint(state), tmp_path / "out", max_shard_size="1KB", unsafe_serialization=fmt == "bin")
    out = tmp_path / "out"
    index_name = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    assert result.index_file == index_name and result.files[-1] == index_name
    index = json.loads((out / index_name).read_text())
    assert index["metadata"] == {"total_size": result.total_bytes}

    ordered = {t.name: state[t.name] for t in result.tensors}  # the checkpoint's order, which the split follows
    pattern = "model{suffix}.safetensors" if fmt == "safetensors" else "pytorch_model{suffix}.bin"
    expected = split_torch_state_dict_into_shards(ordered, filename_pattern=pattern, max_shard_size=1000)
    assert index["weight_map"] == expected.tensor_to_filename
    assert sorted(result.files[:-1]) == sorted(expected.filename_to_tensors)
    assert result.files[0].endswith(f"-00001-of-{len(result.files) - 1:05d}.{fmt}")

    merged: dict[str, torch.Tensor] = {}
    for name in set(index["weight_map"].values()):
        merged |= load_file(out / name) if fmt == "safetensors" else torch.load(out / name, weights_only=True)
    assert sorted(merged) == sorted(state) and all(same_bits(merged[k], state[k]) for k in state)


def test_remerging_replaces_older_output_of_the_same_format_and_keeps_other_files(make_checkpoint, tmp_path):
    folder, out = make_checkpoint(), tmp_path / "out"
    sharded = merge_weights(folder, out, max_shard_size=300)
    assert len(sharded.files) > 2
    (out / "config.json").write_text("{}")
    merge_weights(folder, out, unsafe_serialization=True)
    single = merge_weights(folder, out)
    assert single.replaced_files == sorted(sharded.files)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "pytorch_model.bin"]


def test_remove_checkpoint_dir_deletes_the_folder_after_a_verified_write(make_checkpoint, tmp_path, sample_state):
    folder = make_checkpoint()
    result = merge_weights(folder, tmp_path / "out", remove_checkpoint_dir=True)
    assert result.checkpoint_removed and result.verified and not folder.exists()
    assert folder.parent.exists()  # only the checkpoint folder itself
    assert sorted(load_file(tmp_path / "out" / "model.safetensors")) == sorted(sample_state)


def _corrupt_after_write(monkeypatch):
    original = SafetensorsWriter.close

    def close_then_flip_a_byte(self):
        original(self)
        data = bytearray(self.path.read_bytes())
        data[-2] ^= 0xFF
        self.path.write_bytes(bytes(data))

    monkeypatch.setattr(SafetensorsWriter, "close", close_then_flip_a_byte)


def test_failed_verification_keeps_the_checkpoint_and_the_previous_output(make_checkpoint, tmp_path, monkeypatch):
    folder, out = make_checkpoint(), tmp_path / "out"
    merge_weights(folder, out)
    before = (out / "model.safetensors").read_bytes()
    _corrupt_after_write(monkeypatch)
    with pytest.raises(MergeError, match="did not read back as written.*checkpoint folder was not removed"):
        merge_weights(folder, out, remove_checkpoint_dir=True)
    assert (folder / ".metadata").exists() and (out / "model.safetensors").read_bytes() == before
    assert leftovers(out) == []


def test_failed_verification_of_a_bin_file_leaves_no_new_folder(make_checkpoint, tmp_path, monkeypatch):
    folder = make_checkpoint()
    original = merge_core._write_bin

    def write_then_damage(checkpoint, out, path, tracker, group_bytes):
        sums = original(checkpoint, out, path, tracker, group_bytes)
        with zipfile.ZipFile(path) as archive:  # flip a byte in the middle of the largest tensor's data
            member = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
        data = bytearray(path.read_bytes())
        name_len, extra_len = struct.unpack("<HH", data[member.header_offset + 26: member.header_offset + 30])
        data[member.header_offset + 30 + name_len + extra_len + member.file_size // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        return sums

    monkeypatch.setattr(merge_core, "_write_bin", write_then_damage)
    with pytest.raises(MergeError, match="did not read back as written"):
        merge_weights(folder, tmp_path / "new" / "out", unsafe_serialization=True, remove_checkpoint_dir=True)
    assert folder.exists() and not (tmp_path / "new").exists()


def test_a_write_error_leaves_nothing_behind(make_checkpoint, tmp_path, monkeypatch):
    folder = make_checkpoint()
    calls = {"n": 0}
    original = SafetensorsWriter.write

    def write_until_the_disk_is_full(self, name, tensor):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device", str(self.path))
        original(self, name, tensor)

    monkeypatch.setattr(SafetensorsWriter, "write", write_until_the_disk_is_full)
    with pytest.raises(MergeError, match="No space left on device.*Nothing was kept"):
        merge_weights(folder, tmp_path / "new" / "out", remove_checkpoint_dir=True)
    assert folder.exists() and not (tmp_path / "new").exists()


def test_an_interrupt_mid_merge_leaves_nothing_behind(make_checkpoint, tmp_path):
    out = tmp_path / "out"
    out.mkdir()

    def interrupt(progress: MergeProgress) -> None:
        if progress.tensors_written == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        merge_weights(make_checkpoint(), out, on_progress=interrupt)
    assert list(out.iterdir()) == []  # the folder existed before, so it stays, empty


def test_progress_reaches_done_with_every_byte_written_and_verified(make_checkpoint, tmp_path):
    events: list[MergeProgress] = []
    result = merge_weights(make_checkpoint(), tmp_path / "out", on_progress=events.append)
    assert [e.phase for e in events].count("writing") == len(result.tensors)
    assert events[-2].phase == "verifying" and events[-1].phase == "done" and events[-1].fraction == 1.0
    assert events[-1].bytes_written == events[-1].bytes_verified == result.total_bytes
    fractions = [e.fraction for e in events]
    assert fractions == sorted(fractions)


def test_stderr_progress_stays_quiet_for_quick_merges_and_reports_long_ones(make_checkpoint, tmp_path):
    quiet = io.StringIO()
    merge_weights(make_checkpoint(), tmp_path / "a", on_progress=StderrProgress(quiet))
    assert quiet.getvalue() == ""
    loud = io.StringIO()
    merge_weights(make_checkpoint(), tmp_path / "b", on_progress=StderrProgress(loud, after_s=0, every_s=0))
    lines = loud.getvalue().splitlines()
    assert lines[0].startswith("merge-weights: ") and "writing model.safetensors" in lines[0] and "tensors" in lines[0]
    assert lines[-1].startswith("merge-weights: done: ")


def test_stderr_progress_rewrites_one_line_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    show = StderrProgress(stream, after_s=0, every_s=0)
    show(MergeProgress("writing", "model.safetensors", 5, 0, 10, 1, 2, 1.0))
    show(MergeProgress("done", "", 10, 10, 10, 2, 2, 2.0))
    text = stream.getvalue()
    assert text.startswith("\r") and text.count("\n") == 1 and text.endswith("\n") and " 40% writing" in text


@pytest.mark.parametrize(("text", "size"), [
    ("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30), ("1.5 kb", 1500), ("123", 123), (4096, 4096),
    ("10MiB", 10 * 2**20), ("1TB", 10**12),
])
def test_shard_sizes_read_like_transformers(text, size):
    assert parse_size(text) == size


def test_result_message_and_table_describe_the_merge(make_checkpoint, tmp_path):
    result = merge_weights(make_checkpoint(), tmp_path / "out", max_shard_size=300)
    message = result.message()
    assert message.startswith("Merged 9 tensors (") and "shards in" in message and "read back and checked" in message
    rows = result.table_rows(limit=3)
    assert [r["tensor"] for r in rows[:3]] == [t.name for t in result.tensors[:3]]
    assert rows[3]["tensor"] == "... 6 more" and rows[-1]["tensor"] == "total: 9 tensors"
    assert result.weights_path == tmp_path / "out" / "model.safetensors.index.json"


def test_staging_folders_of_dead_merges_are_removed_and_others_kept(make_checkpoint, tmp_path):
    from prefect_accelerate.merge.staging import STAGING_PREFIX, _host

    out = tmp_path / "out"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    names = {
        "dead": f"{STAGING_PREFIX}{_host()}-{dead}-x1",
        "alive": f"{STAGING_PREFIX}{_host()}-{os.getpid()}-x2",
        "other_host": f"{STAGING_PREFIX}not-{socket.gethostname()}-{dead}-x3",
    }
    for name in names.values():
        (out / name).mkdir(parents=True)
        (out / name / "model.safetensors").write_bytes(b"partial")
    merge_weights(make_checkpoint(), out)
    assert not (out / names["dead"]).exists()
    assert (out / names["alive"]).exists() and (out / names["other_host"]).exists()


def test_sigterm_mid_merge_leaves_no_staging_folder(make_checkpoint, tmp_path):
    script = (
        "import sys, time\n"
        "from prefect_accelerate.merge import merge_weights\n"
        "def slow(progress):\n"
        "    if progress.phase == 'writing':\n"
        "        print('writing', flush=True)\n"
        "        time.sleep(60)\n"
        "merge_weights(sys.argv[1], sys.argv[2], on_progress=slow)\n"
    )
    out = tmp_path / "new" / "out"
    proc = subprocess.Popen([sys.executable, "-c", script, str(make_checkpoint()), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        assert any(p.name.startswith(".merge-weights-") for p in out.iterdir())
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "Terminated" in err
    assert not (tmp_path / "new").exists()
