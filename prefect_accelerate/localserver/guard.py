"""Runs one command and ends it when the process that started this guard dies, however it dies.

The per-command Prefect server (ephemeral.py) must not outlive its command, also after a `kill -9`. A parent
death signal cannot say that: the kernel sends it when the *thread* that forked the child ends, and the server is
started from a short-lived search thread (cli/tracking.py), so the server died as soon as it answered; and setting
it needs Python code between fork and exec, which can deadlock in a process with other threads. So the starter
gives this guard, as its standard input, the read end of a pipe whose write end only the starter holds: end of
file means the starter is gone. The guard then stops the command (SIGTERM, SIGKILL after the grace) and exits;
SIGTERM or SIGINT to the guard does the same; when the command exits, the guard exits with its code.

Run as `python -m prefect_accelerate.localserver.guard COMMAND [ARGS...]`, standard library only.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

#: seconds between the guard's SIGTERM to the command and its SIGKILL
GRACE_SECONDS = 10.0


def _stop(child: subprocess.Popen) -> int:
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(timeout=GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return child.returncode


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m prefect_accelerate.localserver.guard COMMAND [ARGS...]", file=sys.stderr)
        return 2
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    stopping: list[int] = []

    def on_signal(number: int, _frame: object) -> None:
        stopping.append(number)

    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, on_signal)
    while not stopping:
        if child.poll() is not None:
            return child.returncode
        try:
            ready, _, _ = select.select([0], [], [], 0.5)
        except InterruptedError:
            continue
        if ready and not os.read(0, 4096):
            break  # end of file: the starter is gone
    _stop(child)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
