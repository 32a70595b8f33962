"""Where launches keep their run folders and the state files that let a hook end orphaned processes.

PREFECT_ACCELERATE_STATE_DIR, else $XDG_CACHE_HOME/prefect-accelerate, else ~/.cache/prefect-accelerate.
A running launch writes `launches/<id>.json` (pids with their start times, flow and task run ids); a
finished one removes it. `end_recorded_launches` reads them and ends what is left, matching each pid's
start time so a recycled pid is never touched.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import signal
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

STATE_ENV = "PREFECT_ACCELERATE_STATE_DIR"
#: run folders and state files hold logs with the training's output: readable by their owner only
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def make_private_dir(path: Path, what: str = "folder") -> Path:
    """Create `path` (and missing parents) readable by the owner only; a one-paragraph UsageError if it cannot be.

    Folders it creates are owner-only from the start; existing folders outside the state folder keep their
    modes; the folder itself is made owner-only, and so is every folder between the state folder and it (the state folder, runs/, launches/ included): run
    names (script names, times) are nobody else's to list.
    """
    from prefect_accelerate.errors import UsageError

    path = Path(path)
    try:
        _mkdirs_private(path)
        os.chmod(path, PRIVATE_DIR_MODE)
    except OSError as error:
        blocker = next((p for p in [path, *path.parents] if p.exists() and not p.is_dir()), None)
        why = f"{blocker} is a file, not a folder" if blocker is not None else (error.strerror or str(error))
        hint = f" ({STATE_ENV} is {os.environ[STATE_ENV]})" if os.environ.get(STATE_ENV) and what.startswith("state") else ""
        raise UsageError(
            f"Could not create the {what} {path}: {why}{hint}. Choose a folder you can write to (--run_dir for a "
            f"launch's folder, {STATE_ENV} for the state folder), then run the command again."
        ) from None
    _private_state_parents(path)
    return path


def _mkdirs_private(path: Path) -> None:
    """Create `path` and its missing parents owner-only from the start (mkdir's `parents` would make them 0755
    first, and for a moment others could list run names)."""
    missing = []
    folder = path.absolute()
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, PRIVATE_DIR_MODE)
    if not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(path))


def _private_state_parents(path: Path) -> None:
    root = state_dir()
    try:
        relative = path.absolute().relative_to(root.absolute())
    except ValueError:
        return
    for depth in range(len(relative.parts)):
        folder = root.joinpath(*relative.parts[:depth])
        with contextlib.suppress(OSError):
            if not folder.is_symlink() and folder.is_dir() and folder.stat().st_uid == os.getuid():
                os.chmod(folder, PRIVATE_DIR_MODE)


def _default_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "prefect-accelerate"


def state_dir() -> Path:
    if os.environ.get(STATE_ENV):
        return Path(os.path.expanduser(os.environ[STATE_ENV]))
    return _default_dir()


#: where results that only save time are kept (the engines' import check): a folder per machine and user,
#: not per launch, so a per-run PREFECT_ACCELERATE_STATE_DIR still shares them
CACHE_ENV = "PREFECT_ACCELERATE_CACHE_DIR"


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.path.expanduser(os.environ[CACHE_ENV]))
    return _default_dir()


def new_run_dir(prefix: str = "launch") -> Path:
    """A fresh, unique folder name under <state>/runs (not created; `make_private_state_dir` makes its parents)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return state_dir() / "runs" / f"{stamp}-{prefix}-{secrets.token_hex(3)}"


def launches_dir() -> Path:
    return state_dir() / LAUNCHES


#: record folders: local launches (pids), remote SageMaker jobs (job names)
LAUNCHES = "launches"
SAGEMAKER_JOBS = "sagemaker-jobs"


def write_private_json(path: Path, data: Any, what: str = "state folder") -> Path:
    """Write `data` as JSON to `path` atomically, readable by the owner only (its folder too)."""
    make_private_dir(path.parent, what)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(data, indent=1))
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path


def write_record(kind: str, record_id: str, data: dict[str, Any]) -> Path:
    """Write `<state>/<kind>/<record_id>.json` atomically, tagged with this host's name."""
    return write_private_json(state_dir() / kind / f"{record_id}.json", {**data, "host": socket.gethostname()})


def remove_record(kind: str, record_id: str) -> None:
    try:
        (state_dir() / kind / f"{record_id}.json").unlink()
    except FileNotFoundError:
        pass


def read_records(kind: str, flow_run_id: str | None = None, *, this_host: bool = True) -> list[dict[str, Any]]:
    """The records of one kind (optionally only one flow run's); each has its file path under "_path"."""
    folder = state_dir() / kind
    out = []
    for path in sorted(folder.glob("*.json")) if folder.exists() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if this_host and data.get("host") != socket.gethostname():
            continue
        if flow_run_id is not None and str(data.get("flow_run_id")) != str(flow_run_id):
            continue
        data["_path"] = str(path)
        out.append(data)
    return out


def write_state(launch_id: str, data: dict[str, Any]) -> Path:
    return write_record(LAUNCHES, launch_id, data)


def remove_state(launch_id: str) -> None:
    remove_record(LAUNCHES, launch_id)


def recorded_launches(flow_run_id: str | None = None) -> list[dict[str, Any]]:
    """State files of this host's running launches, optionally only those of one flow run."""
    return read_records(LAUNCHES, flow_run_id)


def alive_matching(processes: Iterable[dict[str, Any]]):
    import psutil

    alive = []
    for entry in processes:
        try:
            proc = psutil.Process(int(entry["pid"]))
            # a zombie has ended (only its exit status waits for its parent): nothing to signal or wait for
            if abs(proc.create_time() - float(entry["create_time"])) < 0.05 and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError, ValueError):
            continue
    return alive


def alive_recorded(record: Path):
    """The live processes a state file lists (start times matching), or [] when it is gone or unreadable."""
    try:
        data = json.loads(Path(record).read_text())
    except (OSError, ValueError):
        return []
    return alive_matching(data.get("processes", []))


def end_recorded_launches(flow_run_id: str | None = None, grace: float = 10.0) -> list[int]:
    """End every process recorded for `flow_run_id` (all of this host's when None). Idempotent.

    SIGTERM first (torchrun then stops its workers), SIGKILL after `grace` seconds. Returns the pids
    that were signalled.
    """
    import psutil

    signalled: list[int] = []
    for data in recorded_launches(flow_run_id):
        processes = alive_matching(data.get("processes", []))
        for proc in processes:
            try:
                proc.send_signal(signal.SIGTERM)
                signalled.append(proc.pid)
            except psutil.NoSuchProcess:
                pass
        _, still = psutil.wait_procs(processes, timeout=grace)
        for proc in still:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(still, timeout=5)
        try:
            Path(data["_path"]).unlink()
        except FileNotFoundError:
            pass
    return signalled
