"""The per-command Prefect server of PREFECT_ACCELERATE_SERVER=ephemeral: Prefect's temporary server app, started
for one command in a session of its own and ended with it, however it ends."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from prefect_accelerate.localserver import (
    STOP_GRACE_SECONDS, ServerUnavailable, _free_port, _server_env, healthy, startup_timeout,
)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the command that started it dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_ephemeral(timeout: float | None = None) -> str:
    """Start Prefect's ephemeral server app for this process only, in a session of its own (Ctrl-C does not
    reach it); it is stopped when this process exits, by any path. Returns its API URL."""
    import atexit
    import tempfile

    timeout = startup_timeout() if timeout is None else timeout
    env, flags = _server_env(dict(os.environ))
    env["PREFECT__SERVER_EPHEMERAL"] = "1"  # the app Prefect's own temporary server runs (lighter services)
    log = tempfile.TemporaryFile()  # noqa: SIM115 - read on failure, closed with the process
    port = _free_port()
    argv = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui", *flags]
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                               start_new_session=True, preexec_fn=_die_with_parent)

    def stop() -> None:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=STOP_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)

    atexit.register(stop)
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + timeout
    while not healthy(url, timeout=2.0):
        exited = process.poll()
        if exited is not None or time.monotonic() >= deadline:
            stop()
            log.seek(0)
            tail = " | ".join(log.read().decode(errors="replace").strip().splitlines()[-6:])
            what = f"exited with code {exited}" if exited is not None else f"did not answer within {timeout:.0f} s"
            raise ServerUnavailable(f"the per-command Prefect server {what} ({tail or 'no output'})")
        time.sleep(0.25)
    return url
