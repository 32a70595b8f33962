"""How a launch waits: the supervisor wakes when the launcher exits (a pidfd), not a poll interval later."""

from __future__ import annotations

import os
import select
import subprocess
import sys

from prefect_accelerate.launchers.process import _exit_notice


def test_the_exit_notice_turns_readable_when_the_process_exits_and_not_before():
    process = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    notice = _exit_notice(process)
    try:
        assert notice is not None, "no pidfd on this Linux: the supervisor falls back to sleeping"
        assert select.select([notice], [], [], 0.3)[0] == [], "readable while the process still runs"
        process.stdin.close()  # the child reads EOF and exits
        assert select.select([notice], [], [], 30)[0] == [notice]
        assert process.wait(timeout=5) == 0
    finally:
        if notice is not None:
            os.close(notice)
        process.kill()
        process.wait()


def test_a_process_already_reaped_gives_no_notice_and_the_loop_sleeps_instead():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    assert _exit_notice(process) is None
