"""One SIGTERM policy for every long-running operation (launches, remote jobs, merges).

A plain Python process dies on SIGTERM without running `finally` blocks, so nothing would be cleaned
up. In the main thread of a process where nobody else (Prefect, a training script) installed a
handler, SIGTERM is turned into the Terminated exception, so cleanup runs; the CLI maps it to 128+15.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from prefect_accelerate.errors import Terminated


@contextlib.contextmanager
def sigterm_as_exception() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def handler(signum: int, frame: object) -> None:  # noqa: ARG001
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
