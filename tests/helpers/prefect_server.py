"""A real `prefect server` and process workers on 127.0.0.1 for deployment and cancellation tests.

Everything started here is stopped by pid. Workers need two signals to stop (spike-prefect-torch §3):
SIGTERM, then SIGINT after a few seconds, then SIGKILL as a last resort.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

PREFECT = [sys.executable, "-m", "prefect"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class PrefectServer:
    url: str
    home: Path
    process: subprocess.Popen
    children: list[subprocess.Popen] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        env = {**os.environ, "PREFECT_API_URL": self.url, "PREFECT_HOME": str(self.home), "COLUMNS": "200",
               "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1"}
        env.update(extra)
        return env

    def cli(self, *argv: str, cwd: str | None = None, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([*PREFECT, "--no-prompt", *argv], capture_output=True, text=True, env=self.env(), cwd=cwd, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"prefect {' '.join(argv)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done

    def start(self, argv: list[str], log: Path, cwd: str | None = None, **extra_env: str) -> subprocess.Popen:
        handle = open(log, "w")  # noqa: SIM115 - closed when the process is reaped
        process = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=self.env(**extra_env), cwd=cwd)
        self.children.append(process)
        return process

    def start_worker(
        self, pool: str, log: Path, queue: str | None = None, name: str | None = None, queues: Sequence[str] = ()
    ) -> subprocess.Popen:
        """A process worker on `pool`, polling `queue` and/or every name in `queues` (all queues when none)."""
        argv = [*PREFECT, "worker", "start", "--pool", pool]
        for name_ in ([queue] if queue else []) + list(queues):
            argv += ["--work-queue", name_]
        if name:
            argv += ["--name", name]
        return self.start(argv, log)

    @contextlib.contextmanager
    def client(self):
        """A synchronous Prefect client for this server, from the test process."""
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.url}), get_client(sync_client=True) as client:
            yield client

    def run_deployment(self, name: str, parameters: dict | None = None, **kwargs) -> str:
        """Create a run of deployment `name` (flow-name/deployment-name) and return its id at once."""
        from prefect.deployments import run_deployment
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.url}):
            return str(run_deployment(name, parameters=parameters or {}, timeout=0, as_subflow=False, **kwargs).id)

    def flow_run(self, flow_run_id: str):
        with self.client() as client:
            return client.read_flow_run(flow_run_id)

    def subflow_runs(self, parent_id: str) -> list:
        """The flow runs started from `parent_id` (subflows and run_deployment children)."""
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

        with self.client() as client:
            return client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])))

    def artifacts(self, flow_run_id: str) -> list:
        """Every artifact one flow run created (its tasks' included, its subflows' not)."""
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        with self.client() as client:
            return client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))

    def logs(self, flow_run_id: str) -> list[str]:
        """The log messages of one flow run, oldest first."""
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

        with self.client() as client:
            return [log.message for log in client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))]

    def logs_with(self, flow_run_ids: list[str], *expected: str, timeout: float = 30.0) -> str:
        """The joined log messages of these flow runs once every expected text is in them (a run's state can
        reach the server before its process's last batch of logs does), or whatever is there at the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            text = "\n".join(line for run in flow_run_ids for line in self.logs(str(run)))
            if all(part in text for part in expected) or time.monotonic() > deadline:
                return text
            time.sleep(0.5)


def stop(process: subprocess.Popen, *, worker: bool = False) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)
        return
    if worker:
        process.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)
            return
    process.kill()
    process.wait(timeout=10)


@contextlib.contextmanager
def running_server(home: Path, startup_timeout: float = 120):
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
    env.pop("PREFECT_API_URL", None)
    home.mkdir(parents=True, exist_ok=True)
    log = open(home / "server.log", "w")  # noqa: SIM115
    process = subprocess.Popen([*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                               stdout=log, stderr=subprocess.STDOUT, env=env)
    server = PrefectServer(url, home, process)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if process.poll() is not None:
                raise AssertionError(f"prefect server exited: {(home / 'server.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("prefect server did not become healthy")
            time.sleep(0.5)
        yield server
    finally:
        for child in reversed(server.children):
            stop(child, worker="worker" in " ".join(map(str, child.args)))
        stop(process)
        log.close()


def wait_for_state(server: PrefectServer, flow_run_id: str, states: set[str], timeout: float = 180) -> str:
    """Poll a flow run until its state type is one of `states` (COMPLETED, FAILED, CANCELLED, RUNNING...)."""
    import json

    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        request = urllib.request.Request(f"{server.url}/flow_runs/{flow_run_id}")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                data = json.loads(response.read())
        except (TimeoutError, urllib.error.URLError):
            # a server busy with the run's own workers (2 loaded cores) may answer one poll late: the deadline decides
            time.sleep(1)
            continue
        last = (data.get("state") or {}).get("type")
        if last in states:
            return last
        time.sleep(1)
    raise AssertionError(f"flow run {flow_run_id} stayed in {last}")
