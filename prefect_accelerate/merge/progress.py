"""Progress of a merge: events from the core, and the stderr line the CLI shows for long merges.

The core calls `on_progress(MergeProgress)` after each tensor it writes and each file it verifies. The CLI
turns that into one updating stderr line (a line every few seconds when stderr is not a terminal),
shown only once a merge has run for a couple of seconds, so quick merges stay quiet. The Prefect task
turns the same events into log lines and a progress artifact.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable, Literal, TextIO

from prefect_accelerate.merge.shards import format_size

Phase = Literal["writing", "verifying", "done"]


@dataclass(frozen=True)
class MergeProgress:
    """Where a merge is: bytes and tensors written, bytes verified, the file being worked on."""

    phase: Phase
    file: str
    bytes_written: int
    bytes_verified: int
    total_bytes: int
    tensors_written: int
    total_tensors: int
    elapsed_s: float

    @property
    def fraction(self) -> float:
        """Overall completion in [0, 1]: writing counts for 80 %, reading back for 20 % (it is much faster)."""
        if self.phase == "done":
            return 1.0
        if self.total_bytes == 0:
            return 0.8 if self.phase == "verifying" else 0.0
        return min(1.0, 0.8 * self.bytes_written / self.total_bytes + 0.2 * self.bytes_verified / self.total_bytes)

    def describe(self) -> str:
        if self.phase == "done":
            return f"done: {format_size(self.total_bytes)} in {self.total_tensors} tensors, {self.elapsed_s:.1f} s"
        if self.phase == "verifying":
            detail = f"reading back {self.file} ({format_size(self.bytes_verified)} of {format_size(self.total_bytes)})"
        else:
            rate = f", {format_size(self.bytes_written / self.elapsed_s)}/s" if self.bytes_written >= 10**6 and self.elapsed_s > 0 else ""
            detail = (
                f"writing {self.file} ({format_size(self.bytes_written)} of {format_size(self.total_bytes)}, "
                f"{self.tensors_written} of {self.total_tensors} tensors{rate})"
            )
        return f"{self.fraction * 100:3.0f}% {detail}"


ProgressCallback = Callable[[MergeProgress], None]


class StderrProgress:
    """A progress callback that prints to a stream (stderr), and only for merges longer than `after_s`.

    On a terminal the line is rewritten in place; elsewhere (a log file, CI) one line is printed at most
    every `every_s` seconds, plus the final one.
    """

    def __init__(self, stream: TextIO | None = None, *, after_s: float = 2.0, every_s: float | None = None,
                 prefix: str = "merge-weights: ", clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self.after_s = after_s
        self.every_s = every_s if every_s is not None else (0.2 if self.interactive else 5.0)
        self.prefix = prefix
        self._clock = clock
        self._last = float("-inf")
        self._shown = False
        self._width = 0

    def __call__(self, progress: MergeProgress) -> None:
        if progress.elapsed_s < self.after_s and not (progress.phase == "done" and self._shown):
            return
        now = self._clock()
        if progress.phase != "done" and now - self._last < self.every_s:
            return
        self._last = now
        text = self.prefix + progress.describe()
        if self.interactive:
            end = "\n" if progress.phase == "done" else ""
            self.stream.write("\r" + text.ljust(self._width) + end)
            self._width = 0 if end else len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self._shown = True
