"""The keeper of the long-lived local server: `prefect server start` as its child, in the session the keeper
leads; it stops the server when asked (SIGTERM), or when nobody used it for the idle period, and removes
the record. Started by `ensure_server` as `python -m prefect_accelerate.localserver.keeper HOME PORT IDLE`."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from prefect_accelerate.localserver import (
    KEEPER_START_LIMIT_SECONDS, STOP_GRACE_SECONDS, ServerRecord, _free_port, _log_tail, _port_free, _process,
    _remove_record, _server_env, _write_record, files_dir, healthy, listens, startup_timeout,
)


class _Keeper:
    """Runs `prefect server start` as its child and stops it when asked or when nobody used it for a while."""

    def __init__(self, home: Path, port: int, idle: float) -> None:
        self.home = home
        self.port = port
        self.idle = idle
        self.stop_requested = False
        self.record = ServerRecord(url=self._url(port), port=port, keeper_pid=os.getpid(), started_at=time.time(), idle_seconds=idle)
        self.server: subprocess.Popen | None = None

    @staticmethod
    def _url(port: int) -> str:
        return f"http://127.0.0.1:{port}/api"

    def _request_stop(self, signum: int, frame: object) -> None:  # noqa: ARG002
        self.stop_requested = True

    def _start_server(self) -> subprocess.Popen:
        env, flags = _server_env(dict(os.environ))
        # Prefect's UI asks /ui-settings where its API is, and that answer defaults to the port of Prefect's settings
        # (4200), not the --port the server was started with: a server that could not have 4200 would send its UI to
        # whatever else listens there (another PREFECT_HOME's server, with other runs). Both spellings of the setting
        # are set, so a user's own value of either cannot point our UI elsewhere.
        for name in ("PREFECT_SERVER_UI_API_URL", "PREFECT_UI_API_URL"):
            env[name] = self.record.url
        argv = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(self.port), *flags]
        print(f"[keeper {os.getpid()}] starting: {' '.join(argv)}", flush=True)
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env)

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._request_stop)
        _write_record(self.home, self.record)
        if not self._start_until_healthy():
            return 1
        claimed = self._watch()
        try:
            self._stop_server()
            _remove_record(self.home, os.getpid())
        finally:
            if claimed is not None:
                os.close(claimed)
        return 0

    def _start_until_healthy(self) -> bool:
        limit = time.monotonic() + max(KEEPER_START_LIMIT_SECONDS, startup_timeout())
        attempts = 0
        self.server = self._start_server()
        while True:
            if self.stop_requested or time.monotonic() > limit:
                self._stop_server()
                self._fail("it was stopped while starting" if self.stop_requested else "it did not answer within the keeper's limit")
                return False
            code = self.server.poll()
            if code is not None:
                attempts += 1
                if attempts < 3 and not _port_free(self.port):  # someone took the port between our check and its bind
                    self.port = _free_port()
                    self.record.port, self.record.url = self.port, self._url(self.port)
                    _write_record(self.home, self.record)
                    self.server = self._start_server()
                    continue
                self._fail(f"`prefect server start` exited with code {code} ({_log_tail(self.home) or 'no output'})")
                return False
            # ready when the API answers at the port and the kernel says our server is the one listening there (the
            # port is picked before the server binds it: another listener could have taken it and answer meanwhile)
            if healthy(self.record.url, timeout=2.0) and listens(self.server.pid, self.port):
                import psutil

                self.record.pid = self.server.pid
                self.record.create_time = psutil.Process(self.server.pid).create_time()
                self.record.state = "ready"
                _write_record(self.home, self.record)
                print(f"[keeper {os.getpid()}] server {self.server.pid} ready at {self.record.url}", flush=True)
                return True
            time.sleep(0.25)

    def _fail(self, reason: str) -> None:
        self.record.state, self.record.reason = "failed", reason
        _write_record(self.home, self.record)
        print(f"[keeper {os.getpid()}] {reason}", flush=True)

    def _claim_unused(self) -> int | None:
        """The in-use lock held exclusively (so no command can start using the server), or None while one uses it."""
        fd = os.open(files_dir(self.home) / "server.inuse", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def _clients_connected(self) -> bool:
        """Another program (the UI in a browser, a user's own flow) holds a connection to the server."""
        proc = _process(self.record.pid, self.record.create_time)
        if proc is None:
            return False
        try:
            return any(c.status == "ESTABLISHED" and c.laddr and c.laddr.port == self.port for c in proc.net_connections(kind="tcp"))
        except Exception:
            return False

    def _watch(self) -> int | None:
        """Wait until asked to stop, the server died, or it was unused for the idle period (then: the claimed lock)."""
        assert self.server is not None
        poll = 5.0 if self.idle <= 0 else min(15.0, max(self.idle / 4, 0.5))
        last_used = time.time()
        inuse = files_dir(self.home) / "server.inuse"
        while not self.stop_requested and self.server.poll() is None:
            now = time.time()
            with contextlib.suppress(OSError):
                last_used = max(last_used, inuse.stat().st_mtime)
            if self._clients_connected():
                last_used = now
            if self.idle > 0 and now - last_used >= self.idle:
                claimed = self._claim_unused()
                if claimed is not None:
                    print(f"[keeper {os.getpid()}] unused for {self.idle / 60:g} min: stopping the server", flush=True)
                    return claimed
                last_used = now
            self._sleep(poll)
        return None

    def _sleep(self, seconds: float) -> None:
        """Sleep, but wake within a quarter second of a stop request (a signal does not cut time.sleep short)."""
        until = time.monotonic() + seconds
        while not self.stop_requested and time.monotonic() < until:
            time.sleep(0.25)

    def _stop_server(self) -> None:
        if self.server is None or self.server.poll() is not None:
            return
        self.server.terminate()
        try:
            self.server.wait(timeout=STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait(timeout=10)


def _keep(argv: list[str]) -> int:
    home, port, idle = Path(argv[0]), int(argv[1]), float(argv[2])
    return _Keeper(home, port, idle).run()


if __name__ == "__main__":
    if len(sys.argv) == 4:
        sys.exit(_keep(sys.argv[1:]))
    print("usage: python -m prefect_accelerate.localserver.keeper HOME PORT IDLE_SECONDS (started by prefect-accelerate)", file=sys.stderr)
    sys.exit(2)
