"""`prefect-accelerate pipeline` and `validate` from the command line, untracked (no Prefect): exit codes,
the step table, `--force` parsing, and a failing config."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefect_accelerate.cli.main import build_parser, main
from prefect_accelerate.cli.pipeline_cmd import request_from_args

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "ddp_allreduce.py")
QUIET = ["--mixed_precision", "no", "--dynamo_backend", "no", "--num_machines", "1"]


@pytest.fixture(autouse=True)
def own_state(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_ACCELERATE_STATE_DIR", str(tmp_path / "state"))


def test_force_takes_step_names_or_all():
    args = build_parser().parse_args(["pipeline", "--force", "env", "--force", "memory", "--cpu", "t.py"])
    assert request_from_args(args).force == ["env", "memory"]
    args = build_parser().parse_args(["pipeline", "--cpu", "--force", "all", "t.py"])
    assert request_from_args(args).force == ["all"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["pipeline", "--force", "no-such-step", "t.py"])


@pytest.mark.slow
def test_untracked_pipeline_runs_every_step_then_the_training(tmp_path, capfd):
    config = tmp_path / "cpu.yaml"
    config.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\nmixed_precision: 'no'\n")
    code = main(["pipeline", "--no-track", "--config_file", str(config), "--dynamo_backend", "no", "--no_install_test", EXAMPLE])
    out = capfd.readouterr().out
    assert code == 0, out
    table = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.split()[:1] in (["config"], ["env"], ["install-test"])}
    assert table == {"config": "ran", "env": "ran", "install-test": "skipped"}
    assert "rank 1" in out  # the training itself ran on two processes


def test_untracked_pipeline_stops_at_a_bad_config_and_starts_nothing(tmp_path, capfd):
    config = tmp_path / "bad.yaml"
    config.write_text("distributed_type: MULTI_CPU\nnum_processes: two\n")
    code = main(["pipeline", "--no-track", "--config_file", str(config), *QUIET, EXAMPLE])
    captured = capfd.readouterr()
    assert code != 0
    assert "config" in captured.err and "num_processes" in captured.err and "Traceback" not in captured.err
    assert "rank 0" not in captured.out


def test_untracked_validate_reports_each_config_and_fails_when_one_does(tmp_path, capfd):
    good = tmp_path / "good.yaml"
    good.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\nmixed_precision: 'no'\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: fp32\n")
    assert main(["validate", "--no-track", "--no_install_test", str(good)]) == 0
    assert "ok   good.yaml" in capfd.readouterr().out
    assert main(["validate", "--no-track", "--no_install_test", str(tmp_path)]) == 1
    captured = capfd.readouterr()
    assert "ok   good.yaml" in captured.out and "FAIL bad.yaml" in captured.out and "mixed_precision" in captured.out
    assert "1 of 2 config(s) failed." in captured.err


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_tracked_pipeline_resumes_from_the_cache_in_a_new_process(tmp_path):
    """Two separate CLI processes against one Prefect API: the second takes every preflight step from the
    cache the first one filled (results persisted under PREFECT_HOME), and only the training runs again."""
    import os
    import subprocess
    import sys

    from prefect.settings import PREFECT_API_URL

    config = tmp_path / "cpu.yaml"
    config.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\nmixed_precision: 'no'\n")
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_ACCELERATE_STATE_DIR": str(tmp_path / "state")}
    argv = [sys.executable, "-m", "prefect_accelerate.cli.main", "pipeline", "--track", "--config_file", str(config),
            "--dynamo_backend", "no", EXAMPLE]

    def steps_of(done) -> dict[str, str]:
        assert done.returncode == 0, done.stderr[-3000:]
        names = ("config", "env", "install-test")
        return {line.split()[0]: line.split()[1] for line in done.stdout.splitlines() if line.split()[:1] and line.split()[0] in names}

    first = steps_of(subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300))
    assert first["config"] == "ran" and first["install-test"] == "ran"
    second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert steps_of(second) == {"config": "cached", "env": "cached", "install-test": "cached"}
    assert "all_reduce sum = 3.0" in second.stdout + second.stderr  # the training itself ran again
