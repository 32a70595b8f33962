"""A known secret value given as a script argument (`train.py --tok $HF_TOKEN`, issue 17 item 3) is shown
as *** wherever a command line is shown or stored: dry-run text and JSON, the "Launching" log line,
the result, and the flow run's parameters, logs and artifacts in the Prefect database."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from prefect_accelerate.launchers import plan_launch
from prefect_accelerate.launchers.options import build_launch_options

TOKEN = "hf_argtoken_0123456789"
CLI = [sys.executable, "-m", "prefect_accelerate.cli.main", "launch"]


def test_dry_run_never_shows_a_known_secret_given_as_a_script_argument(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    env = {**os.environ, "HF_TOKEN": TOKEN}
    for extra in ([], ["--json"]):
        done = subprocess.run([*CLI, "--dry-run", *extra, "--num_processes", "1", "train.py", "--tok", TOKEN],
                              capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert TOKEN not in done.stdout + done.stderr
        assert ("--tok" in done.stdout) and ("***" in done.stdout)


def test_plan_and_options_serialize_without_the_secret_argument(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    options = build_launch_options("t.py", ["--tok", TOKEN], num_processes=1, mixed_precision="no", dynamo_backend="no", num_machines=1)
    plan = plan_launch(options, cwd=str(tmp_path))
    assert TOKEN in plan.argv  # the process itself still gets the real argument
    for shown in (plan.model_dump_json(), options.model_dump_json(), plan.describe(), plan.to_json(), plan.command_line()):
        assert TOKEN not in shown


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_a_tracked_launch_stores_no_secret_argument(tmp_path, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.logging.handlers import APILogWorker

    from prefect_accelerate.flows.launch import launch_flow

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    script = tmp_path / "echo_args.py"
    received = tmp_path / "received.txt"
    script.write_text(f"import sys\nopen({str(received)!r}, 'w').write(sys.argv[2])\nprint('args', sys.argv[1:], flush=True)\n")
    options = build_launch_options(str(script), ["--tok", TOKEN], num_processes=1, mixed_precision="no", dynamo_backend="no",
                                   num_machines=1, run_dir=str(tmp_path / "run"))
    plan = plan_launch(options)
    state = launch_flow(options=options, plan=plan, return_state=True)
    result = state.result()
    assert result.succeeded and TOKEN not in result.model_dump_json()
    assert received.read_text() == TOKEN  # the script itself got the real value

    async def stored() -> str:
        # this run's records only: the session's server holds every other test's too, past the API's default limit
        from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId,
                                                    LogFilter, LogFilterFlowRunId)

        run_id = state.state_details.flow_run_id
        async with get_client() as client:
            run = await client.read_flow_run(run_id)
            tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
            logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
            artifacts = await client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
            return "\n".join([
                json.dumps(run.parameters, default=str),
                json.dumps([t.task_inputs for t in tasks], default=str),
                json.dumps([entry.message for entry in logs]),
                json.dumps([a.data for a in artifacts], default=str),
            ])

    APILogWorker.drain_all(timeout=10)
    everything = asyncio.run(stored())
    assert "Launching:" in everything and "args ['--tok', '***']" in everything
    assert TOKEN not in everything
