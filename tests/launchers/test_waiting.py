"""How a launch waits: the supervisor wakes when the launcher exits (a pidfd), not a poll interval later, and a
tracked launch imports Prefect in a thread of lower priority than the training it just started."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading

import pytest

from prefect_accelerate.cli import launch_cmd
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


def test_prefect_is_imported_by_a_deprioritised_thread_and_the_main_thread_keeps_its_priority(monkeypatch):
    seen = []
    real = os.setpriority

    def recorded(which, who, value):
        real(which, who, value)  # raising a thread's nice value needs no privilege
        seen.append((who, os.getpriority(os.PRIO_PROCESS, who), threading.current_thread().name))

    monkeypatch.setattr(os, "setpriority", recorded)
    own = os.getpriority(os.PRIO_PROCESS, 0)  # Linux: the calling thread's own nice value
    launch_cmd._import_behind_the_training()
    assert len(seen) == 1
    thread_id, nice, name = seen[0]
    assert name == "prefect-import" and thread_id != threading.get_native_id()
    assert nice == min(19, own + launch_cmd.IMPORT_NICE)
    assert os.getpriority(os.PRIO_PROCESS, 0) == own, "the main thread (the supervisor's) was deprioritised"
    assert "prefect_accelerate.flows.launch" in sys.modules


def test_an_import_that_fails_in_the_thread_is_raised_in_the_main_thread(monkeypatch):
    monkeypatch.setitem(sys.modules, "prefect_accelerate.flows.launch", None)  # import of it raises ImportError
    with pytest.raises(ImportError):
        launch_cmd._import_behind_the_training()
