"""The run page a user opens, rendered by Prefect's own UI in headless Chromium (Debian's `chromium`):
the page loads, names the run and shows each step's task run, and its Artifacts tab lists every gate's
artifact under the pipeline's own key. Skipped without chromium.

Set PREFECT_ACCELERATE_SCREENSHOT=<file.png> to also save the page as a picture (docs/img/ was made so).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from helpers.processes import end_group

from prefect_accelerate.pipeline.models import PipelineRequest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "ddp_allreduce.py")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")]


class _Chromium:
    """Headless Chromium driven over its DevTools protocol: open a page, then read what it shows as it renders.

    A one-shot `--dump-dom` snapshots the page at a moment of its own choosing, which on a loaded machine can
    be before Prefect's UI has drawn the run; here the test waits (in real time) for the text it looks for.
    """

    def __init__(self, tmp_path: Path):
        self.profile = tmp_path / "chromium-profile"  # a fresh profile: nothing from an earlier run
        shutil.rmtree(self.profile, ignore_errors=True)
        self.log = tmp_path / "chromium.log"
        # --disable-dev-shm-usage: a container's small /dev/shm crashes the renderer and leaves a blank page
        self.process = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={self.profile}",
             "--window-size=1400,1000", "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=self.log.open("w"), start_new_session=True)
        self.next_id = 0
        self.socket = None

    def __enter__(self) -> _Chromium:
        import json
        import urllib.request

        from websockets.sync.client import connect

        active = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + 120
        while not (active.exists() and active.read_text().strip()):
            assert self.process.poll() is None and time.monotonic() < deadline, f"chromium did not start: {self.said()}"
            time.sleep(0.2)
        port = int(active.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as answer:
            pages = [t for t in json.load(answer) if t["type"] == "page"]
        self.socket = connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
        return self

    def __exit__(self, *exc) -> None:
        if self.socket is not None:
            self.socket.close()
        end_group(self.process, timeout=30)

    def said(self) -> str:
        """The end of what chromium printed (its own errors: a crashed renderer, a refused flag)."""
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""

    def call(self, method: str, **params):
        import json

        self.next_id += 1
        self.socket.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:  # events arrive in between; the answer carries our id
            message = json.loads(self.socket.recv(timeout=60))
            if message.get("id") == self.next_id:
                assert "error" not in message, message
                return message["result"]

    def text_once_shown(self, url: str | None, wanted: list[str], seconds: float = 120, click: str | None = None) -> str:
        """The page's title and visible text once all of `wanted` appear in it (or what it showed at the end).
        `url` None stays on the page; `click` names a tab (button or link text) to click until the text shows."""
        if url is not None:
            self.call("Page.navigate", url=url)
        deadline, text = time.monotonic() + seconds, ""
        while time.monotonic() < deadline:
            if click is not None:
                self.call("Runtime.evaluate", expression=(
                    "(() => { const leaves = [...document.querySelectorAll('*')].filter(e => e.children.length === 0);"
                    f" const tab = leaves.find(e => e.textContent.trim() === {click!r}); if (tab) tab.click();"
                    # what the tab lists further down is drawn as it scrolls into view
                    " const last = leaves.filter(e => e.textContent.trim()).pop(); if (last) last.scrollIntoView(); })()"))
            answer = self.call("Runtime.evaluate", expression="document.title + '\\n' + (document.body ? document.body.innerText : '')",
                               returnByValue=True)
            text = answer["result"].get("value") or ""
            if all(item in text for item in wanted):
                break
            time.sleep(1.0)
        return text

    def screenshot(self, path: str) -> None:
        import base64

        Path(path).write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))


def test_the_run_page_shows_the_run_its_steps_and_gate_artifacts(prefect_harness, tmp_path, monkeypatch):
    """On the session's long-lived local server, which serves Prefect's UI as a user's does (no extra start-up)."""
    monkeypatch.setenv("PREFECT_ACCELERATE_STATE_DIR", str(tmp_path / "state"))
    config = tmp_path / "cpu.yaml"
    config.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\nmixed_precision: 'no'\n")
    request = PipelineRequest(script=EXAMPLE, config_file=str(config), launch_flags={"dynamo_backend": "no"}, run_install_test=False)

    from prefect_accelerate.flows.pipeline import launch_training
    from prefect.client.orchestration import get_client

    state = launch_training(request, return_state=True)
    assert state.is_completed(), state.message
    flow_run_id = str(state.state_details.flow_run_id)
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
    page = f"{prefect_harness.url.removesuffix('/api')}/runs/flow-run/{flow_run.id}"
    # the graph itself is a canvas; the page's text names each step's task run (the log rows under it)
    wanted = [f"Flow Run: {flow_run.name}", "config-cpu.yaml", "env-cpu.yaml", "launch-torchrun"]
    with _Chromium(tmp_path) as browser:
        text = browser.text_once_shown(page, wanted)
        for item in wanted:
            assert item in text, (item, text[:2000], browser.said())
        # the run's Artifacts tab lists every gate's artifact under this pipeline's key
        from prefect_accelerate.pipeline.naming import artifact_key

        keys = [artifact_key(kind, request) for kind in ("config-check", "env-report", "pipeline-summary", "launch-result")]
        text = browser.text_once_shown(None, keys, click="Artifacts")
        for key in keys:
            assert key in text, (key, text[-2000:], browser.said())
        picture = os.environ.get("PREFECT_ACCELERATE_SCREENSHOT")
        if picture:
            browser.screenshot(picture)
