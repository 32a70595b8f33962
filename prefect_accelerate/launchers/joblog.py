"""Where a remote job handle's lines go (Slurm, Kubernetes): its tail, then the caller's callback, else the
Prefect run logger in a run, else stdout."""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO


def log_line(label: str, line: str) -> None:
    try:
        from prefect import get_run_logger

        get_run_logger().info("[%s] %s", label, line)
    except Exception:  # outside a flow or task run (MissingContextError), or Prefect not importable
        print(f"[{label}] {line}", flush=True)


def emit_job_line(output: Callable[[str, str], None] | None, tail: deque[str], label: str, line: str) -> None:
    """One already redacted line of a job: kept in the handle's tail, then handed on; a broken callback never
    stops the following of the job."""
    tail.append(line)
    if output is not None:
        with contextlib.suppress(Exception):
            output(label, line)
    else:
        log_line(label, line)


def open_run_log(log_path: Path, run_dir: str | None) -> IO[str]:
    """The job's launch.log in its run folder, the folder owner-only (0700) and the file 0600 from creation, as
    for a local launch (docs/processes.md)."""
    from prefect_accelerate.launchers.state import PRIVATE_FILE_MODE, make_private_dir

    if run_dir:
        make_private_dir(log_path.parent, "run folder")
    return open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE_MODE), "a", encoding="utf-8")
