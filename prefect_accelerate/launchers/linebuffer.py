"""Output lines that arrive before anyone can take them, kept in order and handed over when someone does.

A tracked launch starts the training before its Prefect run exists (cli/launch_cmd.py): the console gets
every line at once, while the lines meant for the run's logs wait here, each with the time it was printed
and its rank label. When the run exists, `attach` hands them over in order and every later line goes
straight through; when there will be no run, `discard` drops them (the console and the run folder's
launch.log have them all). No Prefect import: the receiver is any callable.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

#: (time the line was printed, as time.time(); label; line) -> None
TimedLineCallback = Callable[[float, str, str], None]

#: lines held at most while nobody is attached; older ones are dropped first (launch.log keeps them all)
HOLD_LIMIT = 20_000


class LineBuffer:
    """A LineCallback (label, line) that holds lines until a receiver is attached, then forwards them."""

    def __init__(self, limit: int = HOLD_LIMIT) -> None:
        self._lock = threading.Lock()
        self._held: deque[tuple[float, str, str]] = deque()
        self._limit = max(limit, 1)
        self._dropped = 0
        self._receiver: TimedLineCallback | None = None
        self._discarded = False

    def __call__(self, label: str, line: str) -> None:
        now = time.time()
        with self._lock:
            if self._receiver is not None:
                self._send(now, label, line)
            elif not self._discarded:
                if len(self._held) >= self._limit:
                    self._held.popleft()
                    self._dropped += 1
                self._held.append((now, label, line))

    def attach(self, receiver: TimedLineCallback) -> None:
        """Hand every held line to `receiver` in the order it came, then send it each later line as it comes."""
        with self._lock:  # the output reader waits meanwhile, so no later line overtakes a held one
            if self._discarded:
                return
            self._receiver = receiver
            if self._dropped and self._held:
                self._send(self._held[0][0], "prefect-accelerate",
                           f"[prefect-accelerate] {self._dropped} earlier output line(s) are only in the run folder's launch.log")
            while self._held:
                self._send(*self._held.popleft())

    def discard(self) -> None:
        """Nobody will attach: drop what is held and hold nothing more."""
        with self._lock:
            self._discarded = True
            self._receiver = None
            self._held.clear()

    @property
    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def _send(self, created: float, label: str, line: str) -> None:
        assert self._receiver is not None
        try:
            self._receiver(created, label, line)
        except Exception:  # a broken receiver must not stop the output reader that calls us
            pass
