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
    STOP_GRACE_SECONDS, ServerUnavailable, _free_port, _port_free, _server_env, healthy, listens, startup_timeout,
)


#: ports tried when another listener takes the one picked before the server binds it
PORT_ATTEMPTS = 3


#: the write ends of the guards' pipes (guard.py): held, never written, for as long as this process lives
_LIFELINES: list[int] = []


def _stop(process: subprocess.Popen) -> None:
    """The guard stops its server on SIGTERM; if it does not end in time, its whole process group is killed."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the guard leads a session of its own: its group is ours
            process.wait(timeout=10)


def start_ephemeral(timeout: float | None = None) -> str:
    """Start Prefect's ephemeral server app for this process only, in a session of its own (Ctrl-C does not
    reach it), under a guard (guard.py) that stops it when this process exits, by any path, `kill -9` included.
    Returns its API URL.

    The port is picked here and bound seconds later by the server, so another listener may take it meanwhile:
    then the server exits (it is tried again on another port, `PORT_ATTEMPTS` in all), and the port may answer
    for someone else's server. Ready therefore means: the API answers at the port and the kernel says our
    server process is the one listening there.
    """
    import atexit
    import tempfile

    timeout = startup_timeout() if timeout is None else timeout
    env, flags = _server_env(dict(os.environ))
    env["PREFECT__SERVER_EPHEMERAL"] = "1"  # the app Prefect's own temporary server runs (lighter services)
    deadline = time.monotonic() + timeout
    attempt = 0
    while True:
        attempt += 1
        log = tempfile.TemporaryFile()  # noqa: SIM115 - read on failure, closed with the process
        port = _free_port()
        argv = [sys.executable, "-m", "prefect_accelerate.localserver.guard",
                sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui", *flags]
        read_fd, write_fd = os.pipe()  # not inheritable: no other child of this process holds the write end
        try:
            process = subprocess.Popen(argv, stdin=read_fd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
        except OSError:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        _LIFELINES.append(write_fd)
        atexit.register(_stop, process)
        url = f"http://127.0.0.1:{port}/api"
        while True:
            exited = process.poll()
            if exited is None and healthy(url, timeout=2.0) and listens(process.pid, port):
                return url
            if exited is None and time.monotonic() < deadline:
                time.sleep(0.25)
                continue
            _stop(process)
            if exited is not None and attempt < PORT_ATTEMPTS and not _port_free(port):
                break  # another listener took the port between the pick and the bind: another port
            log.seek(0)
            tail = " | ".join(log.read().decode(errors="replace").strip().splitlines()[-6:])
            what = f"exited with code {exited}" if exited is not None else f"did not answer within {timeout:.0f} s"
            raise ServerUnavailable(f"the per-command Prefect server {what} ({tail or 'no output'})")
