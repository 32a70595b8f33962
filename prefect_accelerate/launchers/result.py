"""LaunchResult: how a launch ended, with the failing worker's own exit code when it can be found.

torchrun always exits 1 when a worker fails; the worker's code and error are in its root-cause report
(the JSON at TORCHELASTIC_ERROR_FILE, written when the worker raised inside `@record`) and in the
"Root Cause" table it prints (spike-prefect-torch §4.3). Both are read here. The failing worker's own
Python exception comes from its per-rank files under torchrun's --log_dir: `error.json` when the script
used `@record`, else the last traceback in its `stderr.log`.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from pydantic import BaseModel, Field

from prefect_accelerate.errors import LaunchError

TIMEOUT_EXIT_CODE = 124

_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
_ROOT_CAUSE = re.compile(r"Root Cause")
#: torchrun's `--tee` prefix on a worker's line: `[default3]:` (role, local rank)
RANK_PREFIX = re.compile(r"^\[(?P<role>[A-Za-z_][\w-]*?)(?P<rank>\d+)\]:")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')
#: how much of a rank's stderr.log is read for its last traceback
_STDERR_TAIL_BYTES = 256 * 1024


class RankFailure(BaseModel):
    rank: int
    exit_code: int


class LaunchResult(BaseModel):
    """The outcome of one launch (one node's processes, or one remote job)."""

    launcher: str
    command: str
    #: the failing worker's exit code when known, else the launcher's own
    exit_code: int
    launcher_exit_code: int | None = None
    failed_ranks: list[RankFailure] = Field(default_factory=list)
    #: the rank torchrun names as root cause (its error message is `error`)
    root_cause_rank: int | None = None
    error: str | None = None
    duration_s: float
    run_dir: str | None = None
    log_path: str | None = None
    tail: list[str] = Field(default_factory=list)
    timed_out: bool = False

    @property
    def succeeded(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def failure_message(self, *, quiet: bool = False) -> str:
        """One paragraph: what failed, the root-cause error, the last output lines (not with `quiet`: the
        `--quiet` flag keeps to the training output already printed), and where the full log is."""
        if self.timed_out:
            head = f"The launch did not finish within its deadline and was stopped after {self.duration_s:.1f} s"
        elif self.failed_ranks:
            first = self.failed_ranks[0]
            others = ", ".join(f"rank {f.rank} (exit code {f.exit_code})" for f in self.failed_ranks[1:])
            head = f"Training failed: rank {first.rank} exited with code {first.exit_code}" + (f"; also {others}" if others else "")
        else:
            head = f"Training failed: the {self.launcher} launcher exited with code {self.exit_code}"
        parts = [head + "."]
        if self.error:
            where = f" (rank {self.root_cause_rank})" if self.root_cause_rank is not None else ""
            parts.append(f"Error{where}: {self.error}.")
        if self.tail and not quiet:
            parts.append("Last lines: " + " | ".join(line.strip() for line in self.tail[-8:] if line.strip()))
        if self.log_path:
            parts.append(f"Full log: {self.log_path}.")
        return " ".join(parts)

    def raise_for_failure(self, *, quiet: bool = False) -> LaunchResult:
        """Return self on success; raise LaunchError (exit code = the worker's) otherwise."""
        if not self.succeeded:
            error = LaunchError(self.failure_message(quiet=quiet), exit_code=self.exit_code if self.exit_code > 0 else 1)
            error.result = self  # type: ignore[attr-defined]  # callers (node_launch) report the whole result
            raise error
        return self


def parse_rank_failures(lines: list[str]) -> tuple[list[RankFailure], int | None]:
    """Failed ranks from torchrun's failure table, the one that most likely started it first.

    torchrun's "root cause" is the earliest failure it recorded, which is often a rank that only crashed
    because a peer vanished (a gloo/NCCL "connection reset"). A rank with a specific exit code (not 1,
    and not the SIGTERM torchrun sends the survivors) is put first. Returns (failures, torchrun's root rank).
    """
    root: list[RankFailure] = []
    others: list[RankFailure] = []
    rank: int | None = None
    in_root = False
    for line in lines:
        if _ROOT_CAUSE.search(line):
            in_root = True
        match = _RANK.match(line)
        if match:
            rank = int(match.group(1))
            continue
        match = _EXITCODE.match(line)
        if match and rank is not None:
            (root if in_root else others).append(RankFailure(rank=rank, exit_code=int(match.group(1))))
            rank = None
    seen: set[int] = set()
    ordered = [f for f in root + others if not (f.rank in seen or seen.add(f.rank))]
    specific = [f for f in ordered if f.exit_code not in (1, -15)]
    generic = [f for f in ordered if f not in specific and f.exit_code != -15]
    terminated = [f for f in ordered if f.exit_code == -15]
    return specific + generic + terminated, (root[0].rank if root else None)


def read_error_file(path: Path) -> tuple[str | None, int | None]:
    """(message, error code) from torchrun's root-cause JSON, or (None, None)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, None
    message = data.get("message")
    if isinstance(message, dict):
        text = message.get("message")
        code = message.get("errorCode")
        return (str(text) if text else None), (int(code) if isinstance(code, int) else None)
    return (str(message) if message else None), None


def _is_library_file(filename: str) -> bool:
    path = os.path.abspath(filename)
    roots = {os.path.abspath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    return (
        "site-packages" in path.split(os.sep) or "dist-packages" in path.split(os.sep)
        or any(path.startswith(root + os.sep) for root in roots) or filename.startswith("<")
    )


def describe_traceback(lines: list[str]) -> str | None:
    """`Type: message (at file, line N, in func)` for the last Python traceback in `lines`, at the last
    frame of the user's code (not the standard library's or an installed package's). None without one."""
    start = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")), default=None)
    if start is None:
        return None
    frames: list[tuple[str, str, str]] = []
    exception: str | None = None
    for line in lines[start + 1:]:
        match = _FRAME.match(line)
        if match:
            frames.append((match["file"], match["line"], match["func"]))
        elif line and not line[0].isspace():
            exception = line.strip()  # the first unindented line after the frames: `ValueError: ...`
            break
    if not exception:
        return None
    user = [frame for frame in frames if not _is_library_file(frame[0])] or frames
    if not user:
        return exception
    file, number, func = user[-1]
    return f"{exception} (at {file}, line {number}, in {func})"


def rank_exception(log_dir: Path, local_rank: int) -> str | None:
    """The exception a worker died of, from its files under torchrun's --log_dir (latest attempt), or None."""
    attempts = sorted(Path(log_dir).glob(f"*/attempt_*/{local_rank}"), key=lambda p: (p.stat().st_mtime, p.name))
    for folder in reversed(attempts):
        error_file = folder / "error.json"
        if error_file.is_file():
            message, _ = read_error_file(error_file)
            stack = _callstack(error_file)
            if message:
                where = describe_traceback(stack.splitlines()) if stack else None
                return where if where and where.startswith(message.split(":", 1)[0]) else message
        stderr = folder / "stderr.log"
        if stderr.is_file():
            with open(stderr, "rb") as handle:
                handle.seek(max(stderr.stat().st_size - _STDERR_TAIL_BYTES, 0))
                text = handle.read().decode("utf-8", errors="replace")
            found = describe_traceback(text.splitlines())
            if found:
                return found
    return None


def _callstack(error_file: Path) -> str | None:
    try:
        data = json.loads(error_file.read_text())
        return str(data["message"]["extraInfo"]["py_callstack"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
