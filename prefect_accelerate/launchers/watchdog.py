"""A small process tied to the supervisor's life: if the supervisor dies without saying so, end its launch.

`kill -9` of the CLI (or of a Prefect worker's flow process) runs no `finally`. The launcher gets a parent
death signal, but the kernel clears that in every process the launcher forks, and double-forked helpers
have left its tree anyway. So each local launch starts this watchdog in a session of its own. It holds the
read end of a pipe whose write end only the supervisor has: end of file without the word "done" means the
supervisor is gone. The watchdog then stops every process carrying the launch's id
(reaper.LAUNCH_ID_ENV) or recorded in its state file, SIGTERM then SIGKILL within WATCHDOG_GRACE, makes
the run folder's files redacted and owner-only, and removes the stale record.

Run as `python -m prefect_accelerate.launchers.watchdog LAUNCH_ID SUPERVISOR_PID RUN_DIR [LOG_DIR]`.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from prefect_accelerate.launchers.sealing import seal_leftovers

#: seconds between the watchdog's SIGTERM and SIGKILL: short, so nothing outlives a killed supervisor by 10 s
WATCHDOG_GRACE = 3.0
DONE = b"done\n"


class Watchdog:
    """The supervisor's side: start the watchdog, then `release()` it on every normal way out."""

    def __init__(self, process: subprocess.Popen | None, write_fd: int | None) -> None:
        self._process, self._fd = process, write_fd

    @classmethod
    def start(cls, launch_id: str, run_dir: Path, log_dir: Path | None, env: dict[str, str]) -> Watchdog:
        read_fd, write_fd = os.pipe()  # not inheritable: the launcher and its workers never hold the write end
        argv = [sys.executable, "-m", "prefect_accelerate.launchers.watchdog", launch_id, str(os.getpid()), str(run_dir)]
        if log_dir is not None:
            argv.append(str(log_dir))
        try:
            process = subprocess.Popen(argv, stdin=read_fd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                       env=env, start_new_session=True)
        except OSError:
            os.close(write_fd)
            return cls(None, None)
        finally:
            os.close(read_fd)
        return cls(process, write_fd)

    def release(self) -> None:
        """The launch ended under our control: the watchdog exits without touching anything."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.write(self._fd, DONE)
            os.close(self._fd)
            self._fd = None
        if self._process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=10)


def _supervisor_alive(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_for_supervisor(supervisor) -> bool:
    """Block until the supervisor releases us (True) or dies (False)."""
    received = b""
    while True:
        ready, _, _ = select.select([0], [], [], 1.0)
        if ready:
            chunk = os.read(0, 64)
            if not chunk:
                return DONE in received
            received += chunk
            if DONE in received:
                return True
        elif not _supervisor_alive(supervisor):  # a forked copy of the supervisor may still hold the write end
            return False


def end_launch(launch_id: str, run_dir: Path, log_dir: Path | None) -> int:
    """Stop every process of the launch, seal its folders and drop its record. Returns how many were stopped."""
    import psutil

    from prefect_accelerate.launchers.reaper import tagged_processes
    from prefect_accelerate.launchers.state import alive_recorded, launches_dir

    record = launches_dir() / f"{launch_id}.json"
    stopped: set[int] = set()
    deadline = time.monotonic() + 3 * WATCHDOG_GRACE
    while time.monotonic() < deadline:
        procs = {p.pid: p for p in [*tagged_processes(launch_id), *alive_recorded(record)] if p.pid != os.getpid()}
        if not procs:
            break
        for proc in procs.values():
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGTERM if proc.pid not in stopped else signal.SIGKILL)
        stopped |= set(procs)
        _, alive = psutil.wait_procs(list(procs.values()), timeout=WATCHDOG_GRACE)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=1)
    seal_leftovers(run_dir, log_dir)
    with contextlib.suppress(FileNotFoundError):
        record.unlink()
    return len(stopped)


def _supervisor_gone(data: dict[str, Any]) -> bool:
    import psutil

    supervisor = data.get("supervisor")
    if not isinstance(supervisor, dict):
        return False  # written before supervisors were recorded: the cancellation hook's business
    try:
        proc = psutil.Process(int(supervisor["pid"]))
        return abs(proc.create_time() - float(supervisor["create_time"])) >= 0.05 or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except (psutil.Error, KeyError, ValueError, TypeError):
        return False


def clear_stale_launches(grace: float = 3.0) -> list[str]:
    """End what is left of this host's launches whose supervisor died (kill -9), redact their leftover logs with
    this environment's secret values, and remove their records. Returns the launch ids cleared."""
    import psutil

    from prefect_accelerate.launchers.reaper import tagged_processes
    from prefect_accelerate.launchers.state import alive_matching, recorded_launches

    cleared = []
    for data in recorded_launches():
        if not _supervisor_gone(data):
            continue
        launch_id = Path(data["_path"]).stem
        procs = {p.pid: p for p in [*alive_matching(data.get("processes", [])), *tagged_processes(launch_id)]}
        for proc in procs.values():
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        _, still = psutil.wait_procs(list(procs.values()), timeout=grace)
        for proc in still:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        log_dir = data.get("log_dir")
        seal_leftovers(Path(data["run_dir"]), Path(log_dir) if log_dir else None)
        with contextlib.suppress(FileNotFoundError):
            Path(data["_path"]).unlink()
        cleared.append(launch_id)
    return cleared


def main(argv: list[str]) -> int:
    import psutil

    launch_id, supervisor_pid, run_dir = argv[0], int(argv[1]), Path(argv[2])
    log_dir = Path(argv[3]) if len(argv) > 3 else None
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the supervisor's to handle
    try:
        supervisor = psutil.Process(supervisor_pid)
    except psutil.Error:
        supervisor = None
    # imported now, so that ending a launch does not wait for imports on a loaded machine
    import prefect_accelerate.launchers.reaper  # noqa: F401
    import prefect_accelerate.launchers.sealing  # noqa: F401

    if supervisor is not None and wait_for_supervisor(supervisor):
        return 0
    end_launch(launch_id, run_dir, log_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
