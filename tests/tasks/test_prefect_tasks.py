"""Tasks and flows on the session's Prefect test server: results, artifacts, logs."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from prefect_accelerate.errors import ConfigError, LaunchError

WORKER = str(Path(__file__).resolve().parents[1] / "launchers" / "scripts" / "worker.py")

pytestmark = pytest.mark.usefixtures("prefect_harness")


def _artifact(key: str):
    """The newest artifact with this key (by update time: artifact ids are not ordered)."""
    from prefect.artifacts import Artifact

    return Artifact.get(key)


def _logs(flow_run_id, expected: tuple[str, ...], timeout: float = 30.0) -> list[str]:
    """The run's log messages once every expected line has arrived (Prefect ships logs in batches from a
    background worker, so they can land after the flow returns), or whatever is there at the timeout."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async def read():
        async with get_client() as client:
            logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            return [log.message for log in logs]

    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    deadline = time.monotonic() + timeout
    while True:
        messages = asyncio.run(read())
        if all(line in messages for line in expected) or time.monotonic() > deadline:
            return messages
        time.sleep(0.2)


def test_check_environment_creates_a_default_config_and_publishes_the_report(hf_home):
    from prefect_accelerate.flows.check import check_environment

    report = check_environment(mixed_precision="bf16")
    assert (hf_home / "accelerate" / "default_config.yaml").exists()
    assert report.config.source == "default" and report.config.entries["mixed_precision"] == "bf16"
    artifact = _artifact("env-report")
    assert artifact is not None and "PyTorch" in artifact.data


def test_config_tasks_return_models_and_refuse_bad_files(tmp_path):
    from prefect import flow

    from prefect_accelerate.tasks.config import config_default, config_update, load_config

    @flow
    def configure(path: str):
        created = config_default(path, "fp16")
        updated = config_update(path)
        return created, updated, load_config(path)

    created, updated, loaded = configure(str(tmp_path / "c.yaml"))
    assert created.written and not updated.written and loaded.config.mixed_precision == "fp16"

    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: NO\nnum_processes: x\n")

    @flow
    def load_bad(path: str):
        return load_config(path)

    with pytest.raises(ConfigError, match="num_processes"):
        load_bad(str(bad))


@pytest.mark.slow
def test_launch_lines_reach_the_run_logger_with_rank_labels_and_an_artifact(monkeypatch):
    from prefect import flow
    from prefect.runtime import flow_run

    from prefect_accelerate.launchers.options import build_launch_options
    from prefect_accelerate.tasks.launch import launch

    monkeypatch.setenv("WORKER_MODE", "allreduce")
    seen = {}

    @flow
    def train():
        seen["id"] = flow_run.id
        return launch(build_launch_options(WORKER, cpu=True, num_processes=2, mixed_precision="no", num_machines=1, dynamo_backend="no"))

    result = train()
    assert result.succeeded
    expected = ("[rank 0] rank 0 of 2 sum 3.0", "[rank 1] rank 1 of 2 sum 3.0")
    messages = _logs(seen["id"], expected)
    assert all(line in messages for line in expected), messages
    env_lines = [m for m in messages if m.startswith("Environment added for the launch:")]
    assert len(env_lines) == 1 and "ACCELERATE_USE_CPU=True" in env_lines[0]
    artifact = _artifact("launch-result")
    assert artifact is not None and "Training succeeded" in artifact.data and "rank 0" not in artifact.data.split("Last output")[0] and "| item | value |" in artifact.data


@pytest.mark.slow
def test_a_failed_launch_fails_the_task_with_the_rank_and_code(monkeypatch):
    from prefect import flow

    from prefect_accelerate.launchers.options import build_launch_options
    from prefect_accelerate.tasks.launch import launch

    monkeypatch.setenv("WORKER_MODE", "fail_rank1")

    @flow
    def train():
        return launch(build_launch_options(WORKER, cpu=True, num_processes=2, mixed_precision="no", num_machines=1, dynamo_backend="no"))

    with pytest.raises(LaunchError, match="rank 1 exited with code 3") as info:
        train()
    assert info.value.exit_code == 3
    assert "Training failed" in _artifact("launch-result").data


@pytest.mark.slow
def test_install_test_task_publishes_its_checks(tmp_path):
    from prefect_accelerate.flows.selftest import install_test_flow

    config = tmp_path / "mc.yaml"
    config.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n")
    report = install_test_flow(config_file=str(config))
    assert report.success and len(report.checks) == 10 and all(c.passed for c in report.checks)
    assert "| all-reduce | pass |" in _artifact("install-test").data


def test_secrets_never_reach_flow_parameters():
    import json

    from pydantic_core import to_jsonable_python

    from prefect_accelerate.launchers.options import build_launch_options

    options = build_launch_options("t.py", num_processes=1, aws_secret_access_key="abc-very-secret")
    assert "abc-very-secret" not in json.dumps(to_jsonable_python(options))
    assert os.environ.get("AWS_SECRET_ACCESS_KEY") != "abc-very-secret"


def test_an_expected_failure_is_logged_as_its_message_and_a_bug_keeps_its_traceback(caplog):
    """Prefect's engines log a raised exception with its traceback; ours (a failed training, a bad config) lose it."""
    import logging

    from prefect import flow, task

    import prefect_accelerate.tasks  # noqa: F401  (installs the filter)

    @task
    def fails(error: Exception):
        raise error

    @flow
    def runs(error: Exception):
        fails(error)

    records = {}
    for error in (LaunchError("the training failed: rank 1 exited with code 4"), ValueError("a bug")):
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="prefect"):
            state = runs(error, return_state=True)
        assert state.is_failed()
        records[type(error).__name__] = [r for r in caplog.records if r.name in ("prefect.task_runs", "prefect.flow_runs")
                                         and r.levelno >= logging.ERROR]
    assert records["LaunchError"] and records["ValueError"]
    assert all(r.exc_info is None for r in records["LaunchError"])
    assert any("rank 1 exited with code 4" in r.getMessage() for r in records["LaunchError"])
    assert any(r.exc_info for r in records["ValueError"]), "a bug must keep its traceback"
