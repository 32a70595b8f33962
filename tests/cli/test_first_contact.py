"""What a new user meets first (issue 28): usage lines, exit codes, and an error that comes alone, before any
warning or Prefect server. Each runs the real CLI in a child process, as a user does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefect_accelerate.cli.main import build_parser

CLI = [sys.executable, "-m", "prefect_accelerate.cli.main"]


def cli(*argv: str, cwd: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def subcommands() -> list[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return list(action.choices)


@pytest.mark.parametrize("command", subcommands())
def test_each_subcommands_usage_names_the_program_and_the_command(command):
    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    usage = action.choices[command].format_usage()
    assert usage.startswith(f"usage: prefect-accelerate {command} "), usage
    assert "<command>" not in usage and "[<args>]" not in usage


def test_a_pipeline_whose_config_file_is_missing_exits_2_like_every_bad_input(tmp_path):
    (tmp_path / "x.py").write_text("print('never runs')\n")
    done = cli("pipeline", "--no-track", "--config_file", "missing.yaml", "x.py", cwd=tmp_path)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "missing.yaml" in done.stderr and "Traceback" not in done.stderr
    assert "never runs" not in done.stdout


@pytest.mark.parametrize("track", ["--no-track", "--track"])
def test_a_run_folder_that_cannot_be_made_is_one_line_with_no_defaults_warning_before_it(tmp_path, track):
    """/proc refuses new folders even to root; the error is the whole of stderr, and nothing started (no server either:
    the folder is checked before tracking is set up)."""
    (tmp_path / "train.py").write_text("print('never runs')\n")
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home")}
    done = cli("launch", track, "--run_dir", "/proc/prefect-accelerate-test/run", "train.py", cwd=tmp_path, env=env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: Could not create the run folder /proc/"), done.stderr
    assert "never runs" not in done.stdout and not (tmp_path / "prefect-home" / "prefect-accelerate").exists()


def test_a_run_folder_made_for_a_launch_that_never_started_is_removed_again(tmp_path):
    """An explicit --track with no server in time exits 2 before the launch: the folder it made is not left behind."""
    (tmp_path / "train.py").write_text("print('never runs')\n")
    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"}  # port 9 (discard): nothing answers
    done = cli("launch", "--track", "--cpu", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", "--run_dir", str(tmp_path / "runs" / "one"), "train.py", cwd=tmp_path, env=env)
    assert done.returncode == 2, done.stderr
    assert (tmp_path / "runs").is_dir() and not (tmp_path / "runs" / "one").exists()


def test_validate_with_no_matching_file_says_so_before_any_prefect_server_starts(tmp_path):
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home")}
    done = cli("validate", str(tmp_path / "nothing-here-*.yaml"), cwd=tmp_path, env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: No config files match {str(tmp_path / 'nothing-here-*.yaml')!r}. Pass files, folders holding .yaml/.json "
        "configs, or glob patterns."]
    assert not (tmp_path / "prefect-home" / "prefect-accelerate").exists()  # no local server was started or recorded


@pytest.mark.slow
def test_check_says_its_api_url_came_from_the_local_servers_record(prefect_harness, tmp_path):
    """With no PREFECT_API_URL set, a tracked `check` reports to the session's local server, found from its record; its
    report names that server as the source, not an environment variable the user never set."""
    config = tmp_path / "cpu.yaml"
    config.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\nmixed_precision: 'no'\n")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    done = cli("check", "--track", "--config_file", str(config), cwd=tmp_path, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if "Prefect API URL" in line)
    assert prefect_harness.url in line and "the local Prefect server of PREFECT_HOME=" in line, line
    assert "environment variable" not in line
