"""Tracked or not: the flag, the environment setting, each command's default, and the tracked path of the
file and report commands (config default/update, to-fsdp2, env, check) run on the session's Prefect server."""

from __future__ import annotations

import argparse
import asyncio

import pytest
import yaml
from prefect.logging.configuration import setup_logging

from prefect_accelerate.cli.main import main
from prefect_accelerate.cli.tracking import TRACK_ENV, should_track, tracking_wanted
from prefect_accelerate.errors import UsageError


# Prefect's console log handler keeps the stderr it was created with; configured here, at collection, it
# gets pytest's session-long stream instead of one test's capture, which is closed when that test ends
setup_logging()


def args(track=None, default=False) -> argparse.Namespace:
    return argparse.Namespace(track=track, tracked_by_default=default)


@pytest.mark.parametrize("setting", ["always", "never", "auto"])
def test_the_flag_wins_over_the_environment_and_the_default(monkeypatch, setting):
    monkeypatch.setenv(TRACK_ENV, setting)
    assert tracking_wanted(args(track=True, default=False)) == (True, True)
    assert tracking_wanted(args(track=False, default=True)) == (False, False)


def test_the_environment_setting_decides_when_no_flag_is_given(monkeypatch):
    monkeypatch.setenv(TRACK_ENV, "always")
    assert tracking_wanted(args(default=False)) == (True, True)  # asked for explicitly
    monkeypatch.setenv(TRACK_ENV, "never")
    assert tracking_wanted(args(default=True)) == (False, False)
    monkeypatch.setenv(TRACK_ENV, " Auto ")
    assert tracking_wanted(args(default=True)) == (True, False) and tracking_wanted(args(default=False)) == (False, False)
    monkeypatch.delenv(TRACK_ENV)
    assert tracking_wanted(args(default=True)) == (True, False) and tracking_wanted(args(default=False)) == (False, False)


def test_a_bad_setting_names_the_variable_and_the_choices(monkeypatch, capfd):
    monkeypatch.setenv(TRACK_ENV, "sometimes")
    with pytest.raises(UsageError, match=f"{TRACK_ENV} is set to 'sometimes'.*`always`, `never` or `auto`"):
        should_track(args())
    assert main(["env"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("error: ") and "sometimes" in err and "Traceback" not in err


def _flow_runs(flow_name: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    async def read():
        async with get_client() as client:
            return await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])))

    return asyncio.run(read())


def _logs(flow_run_id, expected: str) -> list[str]:
    """One flow run's log messages, once `expected` is among them (logs reach the server in batches)."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + 60
    while True:
        with get_client(sync_client=True) as client:
            lines = [r.message for r in client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))]
        if any(expected in line for line in lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.5)


def _completed(flow_name: str) -> int:
    return sum(1 for run in _flow_runs(flow_name) if run.state and run.state.is_completed())


@pytest.mark.usefixtures("prefect_harness")
def test_tracked_file_commands_run_as_flows_with_the_same_results(hf_home, tmp_path, capfd, monkeypatch):
    monkeypatch.delenv(TRACK_ENV, raising=False)
    config = tmp_path / "c.yaml"
    before = {name: _completed(name) for name in ("config-default", "config-update", "to-fsdp2", "env")}

    assert main(["config", "default", "--config_file", str(config), "--mixed_precision", "bf16", "--track"]) == 0
    assert yaml.safe_load(config.read_text())["mixed_precision"] == "bf16"
    capfd.readouterr()
    assert main(["config", "default", "--config_file", str(config), "--track"]) == 0  # refuses without --force, as Accelerate
    assert "--force" in capfd.readouterr().out and yaml.safe_load(config.read_text())["mixed_precision"] == "bf16"

    old = tmp_path / "old.yaml"
    old.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nfp16: true\nnum_processes: 1\n")
    assert main(["config", "update", "--config_file", str(old), "--track"]) == 0
    assert yaml.safe_load(old.read_text())["mixed_precision"] == "fp16" and (tmp_path / "old.yaml.bak").exists()

    fsdp1 = tmp_path / "fsdp1.yaml"
    fsdp1.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nmixed_precision: bf16\nnum_machines: 1\nnum_processes: 2\n"
        "fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n  fsdp_offload_params: false\n  fsdp_version: 1\n"
    )
    out = tmp_path / "fsdp2.yaml"
    assert main(["to-fsdp2", "--config_file", str(fsdp1), "--output_file", str(out), "--track"]) == 0
    converted = yaml.safe_load(out.read_text())["fsdp_config"]
    assert converted["fsdp_version"] == 2 and converted["fsdp_reshard_after_forward"] is True

    assert main(["env", "--config_file", str(config), "--track"]) == 0
    assert "PyTorch version" in capfd.readouterr().out
    after = {name: _completed(name) for name in before}
    # one flow run per call (config default ran twice: it wrote, then refused to overwrite)
    assert after == {name: count + (2 if name == "config-default" else 1) for name, count in before.items()}, (before, after)


@pytest.mark.usefixtures("prefect_harness")
def test_check_runs_tracked_and_untracked_and_can_refuse_to_create(hf_home, capfd, monkeypatch):
    monkeypatch.delenv(TRACK_ENV, raising=False)
    default = hf_home / "accelerate" / "default_config.yaml"

    assert main(["check", "--no-track", "--no_create"]) == 2  # nothing there, and creating is refused
    assert "default_config" in capfd.readouterr().err and not default.exists()

    before = _completed("check-environment")
    known = {run.id for run in _flow_runs("check-environment")}
    assert main(["check", "--mixed_precision", "fp16"]) == 0  # tracked by default: creates the config, and says so
    captured = capfd.readouterr()
    printed = captured.out
    assert f"No Accelerate config at {default}: writing a default one" in captured.err
    assert default.exists() and yaml.safe_load(default.read_text())["mixed_precision"] == "fp16"
    assert "PyTorch version" in printed and _completed("check-environment") == before + 1
    (run,) = [run for run in _flow_runs("check-environment") if run.id not in known]
    assert sum("configuration saved" in line for line in _logs(run.id, "configuration saved")) == 1

    assert main(["check", "--no-track"]) == 0  # now it exists: loaded, reported, not recreated
    captured = capfd.readouterr()
    assert "PyTorch version" in captured.out and "Writing" not in captured.out and "No Accelerate config" not in captured.err
    assert _completed("check-environment") == before + 1


def test_a_tracked_launch_does_not_wait_for_the_heartbeat_thread_at_its_end():
    """Prefect joins its flow-run heartbeat thread, which sleeps in one-second steps, when a run ends; inside
    `bounded_bookkeeping` the run ends without that wait, and Prefect's own behaviour is back afterwards."""
    import logging
    import threading
    import time

    import prefect.flow_engine as flow_engine

    from prefect_accelerate.cli.tracking import bounded_bookkeeping

    emitted = threading.Event()

    class Engine:  # what _send_heartbeats reads from the flow-run engine
        heartbeat_seconds = 30
        flow_run = None
        logger = logging.getLogger("test-heartbeat")

        def _build_heartbeat_event_template(self):
            return {}, []

        def _emit_flow_run_heartbeat(self, resource, related):  # noqa: ARG002
            emitted.set()

    original = flow_engine._send_heartbeats
    with bounded_bookkeeping(flush_seconds=0):
        with flow_engine._send_heartbeats(Engine()):
            assert emitted.wait(30)  # the thread sent its first heartbeat and now sleeps its first second
            ending = time.monotonic()
        took = time.monotonic() - ending
    assert took < 0.5, f"the run's end waited {took:.2f} s for the heartbeat thread"
    assert flow_engine._send_heartbeats is original
