"""torchrun's per-rank log files, redacted before any byte reaches the disk. Imported inside torchrun only.

torchrun opens each worker's `stdout.log`/`stderr.log` itself and hands the open file to the worker, so
whatever the worker prints lands on disk raw (and, with --tee, is then copied to the console from there).
torchrun's documented hook for this is a LogsSpecs class named with `--logs_specs` (entry point group
`torchrun.logs_specs`, name `prefect_accelerate`; the supervisor adds the flag, see process.py). Ours keeps
torchrun's folder layout but gives each worker a named pipe instead of the file: a thread in torchrun reads
the pipe, replaces secret values line by line, and appends to the real file, created owner-only. torchrun's
tee then copies the redacted file to the console, so the supervisor's stream is redacted too.

Secret values are those of this process's environment (secrets.known_secret_values, which also reads the
names a plan marked secret from PREFECT_ACCELERATE_SECRET_NAMES).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading

from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, LogsDest

from prefect_accelerate.secrets import Redactor, known_secret_values

#: a line longer than this without a newline is written out (redacted) in pieces; the last piece is held
#: back by the longest secret's length, so a secret cut by the split is still found whole
MAX_PENDING = 1 << 20
#: how long torchrun's exit waits for the pumps to write what they still hold
DRAIN_SECONDS = 3.0

_pumps: list[threading.Thread] = []


class RedactingLogsSpecs(DefaultLogsSpecs):
    """DefaultLogsSpecs whose worker stdout/stderr files are written through the redactor, owner-only."""

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = super().reify(envs)
        redact = Redactor(known_secret_values())
        for streams in (dest.stdouts, dest.stderrs):
            for rank, path in list(streams.items()):
                if path and path != os.devnull:
                    streams[rank] = _start_pump(path, redact)
        for path in (dest.filtered_stdout, dest.filtered_stderr):
            if path and self._local_ranks_filter and os.path.isdir(os.path.dirname(path)):
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))  # torchrun opens it "w" later: mode kept
        for path in [*dest.error_files.values(), *dest.stdouts.values()]:
            _private_parents(path)
        return dest


def _private_parents(path: str) -> None:
    """The attempt and rank folders torchrun made (0755 by umask): owner-only."""
    if not path or path == os.devnull:
        return
    folder = os.path.dirname(os.path.abspath(path))
    for target in (folder, os.path.dirname(folder)):
        with contextlib.suppress(OSError):
            os.chmod(target, 0o700)


def _start_pump(path: str, redact: Redactor) -> str:
    """Create `path` owner-only and return a named pipe next to it whose lines a thread appends to it, redacted."""
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o600)
    folder, name = os.path.split(path)
    pipe = os.path.join(folder, f".{name}.pipe")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(pipe)
    os.mkfifo(pipe, 0o600)
    thread = threading.Thread(target=_pump, args=(pipe, target, redact), name=f"redact {name}", daemon=True)
    thread.start()
    _pumps.append(thread)
    return pipe


def _pump(pipe: str, target: int, redact: Redactor) -> None:
    source = os.open(pipe, os.O_RDONLY | os.O_CLOEXEC)  # returns once torchrun opened it for the worker
    with contextlib.suppress(FileNotFoundError):
        os.unlink(pipe)  # both ends are open: the name is no longer needed
    secrets = [value.encode("utf-8", errors="surrogateescape") for value in redact.values]
    pending = b""
    try:
        while True:
            chunk = os.read(source, 65536)
            if not chunk:
                break
            pending += chunk
            cut = pending.rfind(b"\n") + 1
            if not cut and len(pending) > MAX_PENDING:
                cut = safe_cut(pending, len(pending) // 2, secrets)
            if cut > 0:
                _write(target, pending[:cut], redact)
                pending = pending[cut:]
        if pending:
            _write(target, pending, redact)
    finally:
        os.close(source)
        os.close(target)


def safe_cut(data: bytes, cut: int, secrets: list[bytes]) -> int:
    """`cut`, moved forward past any secret that would straddle it, so each side is redacted whole.

    Called with a cut well inside `data` (half of a megabyte-long line), so a secret that straddles it ends
    within `data`; what follows the cut stays pending and meets the next read.
    """
    moved = True
    while moved:
        moved = False
        for secret in secrets:
            start = data.find(secret, max(cut - len(secret) + 1, 0))
            if start != -1 and start < cut < start + len(secret):
                cut, moved = start + len(secret), True
    return cut


def _write(target: int, data: bytes, redact: Redactor) -> None:
    text = redact(data.decode("utf-8", errors="surrogateescape"))
    out = text.encode("utf-8", errors="surrogateescape")
    while out:
        written = os.write(target, out)
        out = out[written:]


@atexit.register
def _drain() -> None:
    """At torchrun's exit, let the pumps write what the workers printed last (bounded: a daemonized
    grandchild may hold a pipe open forever; the supervisor stops it)."""
    import time

    deadline = time.monotonic() + DRAIN_SECONDS
    for thread in _pumps:
        thread.join(timeout=max(deadline - time.monotonic(), 0))
