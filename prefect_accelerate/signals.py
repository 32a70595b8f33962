"""One SIGTERM policy for every long-running operation (launches, remote jobs, merges).

A plain Python process dies on SIGTERM without running `finally` blocks, so nothing would be cleaned
up. In the main thread of a process where nobody else (Prefect, a training script) installed a
handler, SIGTERM is turned into the Terminated exception, so cleanup runs; the CLI maps it to 128+15.

Both handlers also record the signal. Code we do not own can swallow the exception a handler raises:
Ctrl-C landing inside `import torch` (env's probe) was caught there, and `env` went on to print a report
and exit 0. The CLI asks `received_signal()` after a command returns, so a stop is never reported as a
success.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from prefect_accelerate.errors import Terminated


_received: int | None = None


def received_signal() -> int | None:
    """The stop signal (SIGINT or SIGTERM) a handler of ours saw since `interrupts_recorded()` began, else None."""
    return _received


def raise_if_stopped() -> None:
    """Raise the stop a handler recorded (KeyboardInterrupt or Terminated): call it after code that may swallow one."""
    if _received is not None:
        raise KeyboardInterrupt if _received == signal.SIGINT else Terminated(_received)


@contextlib.contextmanager
def interrupts_recorded() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt as usual and is also recorded (main thread, SIGINT not ignored)."""
    global _received
    _received = None
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return

    def handler(signum: int, frame: object) -> None:  # noqa: ARG001
        global _received
        _received = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def sigterm_as_exception() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def handler(signum: int, frame: object) -> None:  # noqa: ARG001
        global _received
        _received = signum
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
