"""The merge-weights command line without a checkpoint launch: flags, and what `--help` imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from prefect_accelerate.cli import main as cli_main

MODULE = "prefect_accelerate.cli.merge_cmd"


@pytest.fixture
def cli():
    return cli_main


def test_the_installed_command_lists_merge_weights():
    script = Path(sys.executable).with_name("prefect-accelerate")
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "merge-weights" in done.stdout, done.stderr
    assert MODULE in cli_main.COMMAND_MODULES


def test_flags_take_accelerates_names_and_hyphen_spellings(cli):
    args = cli.build_parser().parse_args(
        ["merge-weights", "ckpt", "out", "--unsafe-serialization", "--remove_checkpoint_dir", "--max-shard-size", "5GB", "--no-track"]
    )
    assert (args.checkpoint_directory, args.output_path) == ("ckpt", "out")
    assert args.unsafe_serialization and args.remove_checkpoint_dir and args.max_shard_size == "5GB"
    assert args.track is False and args.tracked_by_default is True


def test_defaults_match_accelerate_and_transformers(cli):
    args = cli.build_parser().parse_args(["merge-weights", "ckpt", "out"])
    assert not args.unsafe_serialization and not args.remove_checkpoint_dir and args.max_shard_size == "50GB"


def test_default_shard_size_is_the_merge_packages(cli):
    from prefect_accelerate.cli.merge_cmd import DEFAULT_MAX_SHARD_SIZE as cli_default
    from prefect_accelerate.merge import DEFAULT_MAX_SHARD_SIZE

    assert cli_default == DEFAULT_MAX_SHARD_SIZE


def test_untracked_merge_prints_the_result(cli, make_checkpoint, tmp_path, capsys):
    assert cli.main(["merge-weights", str(make_checkpoint()), str(tmp_path / "out"), "--no-track"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("Merged 9 tensors") and out.err == ""  # quick merges show no progress


def test_errors_are_one_paragraph_with_exit_code_2(cli, tmp_path, capsys):
    assert cli.main(["merge-weights", str(tmp_path), str(tmp_path / "out"), "--no-track"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "The folder is empty" in err


def test_parsing_imports_neither_torch_nor_prefect():
    probe = (
        "import sys, prefect_accelerate.cli.main as m; "
        "m.build_parser().parse_args(['merge-weights', 'a', 'b']); "
        "print(sorted(x for x in ('torch', 'prefect', 'safetensors') if x in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stderr
