"""Process-tree checks shared by the real-process tests: workers write pid files; tests poll until they are gone."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil


def read_pids(folder: Path) -> list[int]:
    return [int(p.read_text()) for p in folder.glob("*.pid") if p.read_text().strip()]


def wait_for_pids(folder: Path, count: int, timeout: float = 180) -> list[int]:
    """The pids written into `folder` once at least `count` processes have written theirs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = read_pids(folder)
        if len(pids) >= count:
            return pids
        time.sleep(0.25)
    found = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
    raise AssertionError(f"only {found} of {count} processes started")


def assert_all_gone(pids: list[int], timeout: float = 30) -> None:
    """Poll until none of `pids` is alive (zombies count as gone)."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if running(pid)]
        time.sleep(0.2)
    assert not alive, f"processes still alive: {alive}"


def running(pid: int) -> bool:
    """Alive and not a zombie; a process that ends while it is looked at (between psutil's calls) is gone."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def end_group(process: subprocess.Popen, timeout: float = 10) -> None:
    """End a process started with start_new_session=True and everything in its group: SIGTERM, then SIGKILL."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=timeout)
