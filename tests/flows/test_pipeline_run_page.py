"""The run page a user opens, rendered by Prefect's own UI in headless Chromium (Debian's `chromium`):
the page loads, names the run and shows each step's task run. Skipped without chromium.

Set PREFECT_ACCELERATE_SCREENSHOT=<file.png> to also save the page as a picture (docs/img/ was made so).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from prefect_accelerate.pipeline.models import PipelineRequest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "ddp_allreduce.py")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")]


def _browser(url: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "chromium-profile"  # a fresh profile per call: nothing from an earlier run
    shutil.rmtree(profile, ignore_errors=True)
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
            "--window-size=1400,1000", "--virtual-time-budget=30000", *extra, url]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


def test_the_run_page_shows_the_run_its_steps_and_gate_artifacts(tmp_path, monkeypatch):
    from helpers import prefect_server

    # the UI asks the server for its API address; it must be the port the server really listens on
    port = prefect_server.free_port()
    monkeypatch.setattr(prefect_server, "free_port", lambda: port)
    monkeypatch.setenv("PREFECT_UI_API_URL", f"http://127.0.0.1:{port}/api")
    monkeypatch.setenv("PREFECT_ACCELERATE_STATE_DIR", str(tmp_path / "state"))
    config = tmp_path / "cpu.yaml"
    config.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\nmixed_precision: 'no'\n")
    request = PipelineRequest(script=EXAMPLE, config_file=str(config), launch_flags={"dynamo_backend": "no"}, run_install_test=False)

    with prefect_server.running_server(tmp_path / "prefect-home") as server:
        from prefect.settings import PREFECT_API_URL, temporary_settings

        from prefect_accelerate.flows.pipeline import launch_training

        with temporary_settings({PREFECT_API_URL: server.url}):
            state = launch_training(request, return_state=True)
        assert state.is_completed(), state.message
        flow_run = server.flow_run(str(state.state_details.flow_run_id))
        page = f"{server.url.removesuffix('/api')}/runs/flow-run/{flow_run.id}"
        dom = _browser(page, tmp_path, "--dump-dom").stdout
        assert f"<title>Flow Run: {flow_run.name} " in dom, dom[:2000]
        # the graph itself is a canvas; the page's text names each step's task run (the log rows under it)
        for text in ("config-cpu.yaml", "env-cpu.yaml", "launch-torchrun"):
            assert text in dom, text
        picture = os.environ.get("PREFECT_ACCELERATE_SCREENSHOT")
        if picture:
            _browser(page, tmp_path, f"--screenshot={picture}")
