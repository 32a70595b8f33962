"""Hostile paths and files: special files, huge files, links, modes, leftovers of killed writers (issue 17)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from prefect_accelerate.config.fsdp2 import convert_to_fsdp2
from prefect_accelerate.config.io import MAX_CONFIG_BYTES, load_config_path, write_text_atomic
from prefect_accelerate.config.update import update_config_file
from prefect_accelerate.errors import ConfigError

SINGLE = "compute_environment: LOCAL_MACHINE\ndistributed_type: NO\nfp16: true\nnum_processes: 1\n"


def test_a_link_to_dev_zero_is_refused_without_reading_it(tmp_path):
    link = tmp_path / "zero.yaml"
    link.symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match="character device, not a regular file"):
        load_config_path(link)


def test_a_fifo_config_is_named_as_such_and_never_blocks(tmp_path):
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    outcome: list[BaseException] = []

    def load() -> None:
        try:
            load_config_path(fifo)
        except BaseException as error:  # noqa: BLE001 - recorded for the assertion
            outcome.append(error)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive(), "reading a FIFO blocked"
    assert isinstance(outcome[0], ConfigError) and "named pipe (FIFO)" in str(outcome[0])
    with pytest.raises(ConfigError, match="named pipe"):
        update_config_file(fifo)


def test_a_config_larger_than_any_config_is_refused_quickly(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("distributed_type: NO\n" + "# padding\n" * (MAX_CONFIG_BYTES // 10 + 10))
    with pytest.raises(ConfigError, match="a config is a few kilobytes"):
        load_config_path(big)


def test_twenty_thousand_unknown_keys_give_a_short_error(tmp_path):
    path = tmp_path / "many.yaml"
    path.write_text("distributed_type: NO\n" + "".join(f"unknown_key_{i}: 1\n" for i in range(20_000)))
    with pytest.raises(ConfigError) as caught:
        load_config_path(path)
    message = str(caught.value)
    assert "and 19,990 more" in message and len(message) < 3000


def test_a_long_bad_value_is_shortened_in_the_error(tmp_path):
    path = tmp_path / "long.yaml"
    path.write_text("distributed_type: NO\nnum_processes: " + "x" * 50_000 + "\n")
    with pytest.raises(ConfigError) as caught:
        load_config_path(path)
    assert "num_processes" in str(caught.value) and len(str(caught.value)) < 1000


def test_update_writes_through_a_link_and_keeps_the_backup_beside_the_target(tmp_path):
    real = tmp_path / "real" / "cfg.yaml"
    real.parent.mkdir()
    real.write_text(SINGLE)
    link = tmp_path / "link.yaml"
    link.symlink_to(real)
    result = update_config_file(link)
    assert result.written and link.is_symlink()
    assert "mixed_precision: fp16" in real.read_text()
    assert (real.parent / "cfg.yaml.bak").read_text() == SINGLE


def test_backup_keeps_the_originals_mode_and_new_files_follow_the_umask(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(SINGLE)
    path.chmod(0o644)
    update_config_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "c.yaml.bak").stat().st_mode) == 0o644
    old = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "new.yaml", SINGLE)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.yaml").stat().st_mode) == 0o644


def test_temp_files_left_by_a_killed_writer_are_cleaned_on_the_next_write(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(SINGLE)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    stale = tmp_path / f".c.yaml.{dead.stdout.strip()}.abc123.tmp"
    stale.write_text("half a file")
    stale_bak = tmp_path / f".c.yaml.bak.{dead.stdout.strip()}.def456.tmp"
    stale_bak.write_text("half a backup")
    busy = tmp_path / f".c.yaml.{os.getppid()}.zzz.tmp"  # a live writer's (the parent process is alive)
    busy.write_text("in progress")
    update_config_file(path)
    assert not stale.exists() and not stale_bak.exists() and busy.exists()


@pytest.mark.parametrize("then", ["read", "unchanged write"])
def test_a_backup_temp_left_by_a_kill_during_the_rename_is_cleared_by_the_next_read_or_write(tmp_path, then):
    """A kill during the backup's rename leaves `.NAME.bak.<pid>.*.tmp`: the next read of the config, or a write
    that changes nothing (so makes no backup), clears it; a live writer's temp file is kept."""
    from prefect_accelerate.config.io import load_config_path

    path = tmp_path / "c.yaml"
    path.write_text(SINGLE)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    stale_bak = tmp_path / f".c.yaml.bak.{dead.stdout.strip()}.def456.tmp"
    stale_bak.write_text("half a backup")
    busy_bak = tmp_path / f".c.yaml.bak.{os.getppid()}.zzz.tmp"  # a live writer's (the parent process is alive)
    busy_bak.write_text("in progress")
    if then == "read":
        load_config_path(path)
    else:
        write_text_atomic(path, path.read_text())
    assert not stale_bak.exists() and busy_bak.exists()


@pytest.mark.parametrize("blocker", ["file", "unwritable"])
def test_an_uncreatable_folder_is_one_paragraph_not_a_traceback(tmp_path, blocker):
    if blocker == "file":
        (tmp_path / "f").write_text("")
        target = tmp_path / "f" / "sub" / "c.yaml"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes anywhere")
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        target = locked / "sub" / "c.yaml"
    with pytest.raises(ConfigError, match=r"Could not write .*c\.yaml") as caught:
        write_text_atomic(target, SINGLE)
    if blocker == "file":
        assert "is a file, not a folder" in str(caught.value)


def test_to_fsdp2_without_fsdp_says_one_thing_and_writes_nothing(tmp_path):
    source = tmp_path / "plain.yaml"
    source.write_text(SINGLE)
    out = tmp_path / "out.yaml"
    result = convert_to_fsdp2(source, out)
    assert not out.exists() and not result.converted
    assert result.message().count("\n") == 0 and "nothing was written" in result.message()
    assert "Wrote" not in result.message()
