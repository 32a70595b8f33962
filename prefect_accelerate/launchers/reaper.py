"""Finding every process a launch started, however it detached, and tying them to the supervisor's life.

Mechanism in force (docs/processes.md):
- Linux: the supervising process makes itself a *child subreaper* (prctl PR_SET_CHILD_SUBREAPER). A
  training script's helper that double-forks (`setsid -f`, a classic daemon) is then re-parented to the
  supervisor instead of PID 1, so it stays a descendant we can list, stop and reap. Every process of a
  launch also carries PREFECT_ACCELERATE_LAUNCH_ID in its environment: an adopted child is ours to stop
  only when it carries this launch's id (or was seen under the launcher), never another caller's child.
- The launcher gets PR_SET_PDEATHSIG (SIGTERM) and a watchdog (launchers/watchdog.py) watches the
  supervisor: if the supervisor is killed with -9, the watchdog ends everything tagged with the launch id.
- Elsewhere (macOS) there is no subreaper: a descendant that detaches before the supervisor's next poll
  (0.2 s) is found only through the state record and the watchdog's scan for the launch id.

A cgroup would also hold every descendant, but it needs a writable cgroup v2 subtree (systemd delegation);
the machines this was built on have cgroup v1 only, so the subreaper is the one mechanism used.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading

#: every process of a launch inherits this variable (value: the launch id); the watchdog and the
#: supervisor recognise adopted orphans by it
LAUNCH_ID_ENV = "PREFECT_ACCELERATE_LAUNCH_ID"

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
_subreaper_lock = threading.Lock()
#: launches of this process holding the subreaper attribute now
_subreaper_holders = 0
#: whether we turned the attribute on (so the last launch turns it off)
_subreaper_ours = False


_libc_prctl = None


def _prctl_function():
    """libc's prctl, resolved once in this process (never inside a forked child, where an import could block)."""
    global _libc_prctl
    if _libc_prctl is None and sys.platform.startswith("linux"):
        import ctypes

        try:
            _libc_prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            _libc_prctl = False
    return _libc_prctl or None


def _prctl(option: int, value: int, function=None) -> bool:
    function = function or _prctl_function()
    return function is not None and function(option, value, 0, 0, 0) == 0


def become_subreaper() -> bool:
    """Hold the child-subreaper attribute for one launch; True when it is in force. Pair with `release_subreaper`.

    It applies to the whole process: an orphan of anything this process starts meanwhile is adopted by it.
    Launches reap only the adopted orphans they own (`reap_adopted`), so other callers' children are left alone;
    and the attribute is held only while a launch runs (the last one to end turns it off again, unless it was on
    before we came), so a long-lived process (a notebook, a worker, a test session) does not collect the
    orphans, and then the zombies, of everything else it runs.
    """
    global _subreaper_holders, _subreaper_ours
    with _subreaper_lock:
        if _subreaper_holders == 0:
            already = _subreaper_in_force()
            _subreaper_ours = not already and _prctl(_PR_SET_CHILD_SUBREAPER, 1)
            if not (already or _subreaper_ours):
                return False
        _subreaper_holders += 1
        return True


def release_subreaper() -> None:
    """One launch that held the attribute (`become_subreaper` answered True) is over."""
    global _subreaper_holders, _subreaper_ours
    with _subreaper_lock:
        if _subreaper_holders == 0:
            return
        _subreaper_holders -= 1
        if _subreaper_holders == 0 and _subreaper_ours:
            _prctl(_PR_SET_CHILD_SUBREAPER, 0)
            _subreaper_ours = False


def _subreaper_in_force() -> bool:
    """Whether this process already is a child subreaper (set by whoever started us, or by its own code)."""
    function = _prctl_function()
    if function is None:
        return False
    import ctypes

    flag = ctypes.c_int(0)
    return function(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0 and flag.value != 0


def die_with_parent(parent: int, prctl) -> None:
    """preexec_fn for the launcher: SIGTERM when the thread that started it dies (kill -9 of the supervisor).

    The kernel sends it when the parent *thread* ends, so it is set only for launches started by the main
    thread (`parent_death_hook`). A parent that died before the prctl took effect ends the child at once.
    It is cleared in the launcher's own children (fork), which is why the watchdog exists.
    """
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), prctl)
    if os.getppid() != parent:
        os._exit(1)


def parent_death_hook():
    """The preexec_fn to start a launcher with, or None where a parent-death signal would fire wrongly."""
    if threading.current_thread() is not threading.main_thread():
        return None
    prctl = _prctl_function()
    if prctl is None:
        return None
    return functools.partial(die_with_parent, os.getpid(), prctl)


def carries_launch_id(proc, launch_id: str) -> bool:
    """Whether a live process's environment names this launch (False when it cannot be read)."""
    import psutil

    try:
        return proc.environ().get(LAUNCH_ID_ENV) == launch_id
    except (psutil.Error, OSError):
        return False


def adopted_children(launch_id: str, known: set[int]):
    """Our direct children that belong to this launch: re-parented orphans (subreaper) carrying its id or already
    known as its descendants. The launcher itself (a Popen of ours) is in `known` and left to Popen."""
    import psutil

    found = []
    try:
        children = psutil.Process().children()
    except psutil.Error:
        return found
    for child in children:
        if child.pid in known or carries_launch_id(child, launch_id):
            found.append(child)
    return found


def tagged_processes(launch_id: str):
    """Every live process of this user carrying the launch id, wherever it was re-parented (the watchdog's scan)."""
    import psutil

    me = os.getpid()
    found = []
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE and carries_launch_id(proc, launch_id):
                found.append(proc)
    return found


def reap_adopted(seen: dict[int, float], exclude: int) -> None:
    """Collect the exit status of this launch's adopted orphans that have ended, so no zombie piles up.

    `seen` maps pid -> start time. Only those pids (never `exclude`, the launcher Popen waits for) are waited
    for, one by one and only when the zombie's start time matches: a wait for any child would steal the status
    another subprocess.Popen of this process waits for.
    """
    import psutil

    me = os.getpid()
    for pid, started in seen.items():
        if pid == exclude:
            continue
        with contextlib.suppress(psutil.Error, ChildProcessError, OSError):
            proc = psutil.Process(pid)
            if proc.ppid() == me and proc.status() == psutil.STATUS_ZOMBIE and abs(proc.create_time() - started) < 0.05:
                os.waitpid(pid, os.WNOHANG)
