"""Run a LaunchPlan as a supervised local process tree. No Prefect import: callers pass a line callback.

Facts this module is built on (spike-prefect-torch §3.1, §4.3, §4.4; prefect-and-peers §2.8):
- torchrun starts every worker in a session of its own, so a process-group signal never reaches them;
  SIGTERM to torchrun stops them within a second, while SIGKILL to torchrun orphans them.
- Prefect delivers cancellation as an exception in the main thread; `subprocess.run` answers any
  exception with SIGKILL. So: Popen, our own wait loop, and on every exit path SIGTERM to the launcher,
  a grace period shorter than Prefect's 30 s, then SIGKILL for the launcher and every descendant we saw.
- The launcher starts in its own session and its pids go to a state file, so a flow-level hook can
  end them if this process is killed before it could (launchers/state.py).
- Nothing outlives the launch (issue 27): this process is a child subreaper, so helpers that double-fork
  are re-parented to us and stopped with the rest, on every path including a normal end; a watchdog and
  a parent-death signal end the launch if this process is killed with -9 (reaper.py, watchdog.py); and
  torchrun's per-rank logs are written through the redactor (ranklogs.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect_accelerate.errors import LaunchError
from prefect_accelerate.signals import sigterm_as_exception
from prefect_accelerate.launchers.plan import LaunchPlan
from prefect_accelerate.secrets import SECRET_NAMES_ENV, Redactor
from prefect_accelerate.launchers.reaper import LAUNCH_ID_ENV, become_subreaper, parent_death_hook, release_subreaper
from prefect_accelerate.launchers.sealing import seal_folder
from prefect_accelerate.launchers.watchdog import Watchdog
from prefect_accelerate.launchers.result import (
    RANK_PREFIX, TIMEOUT_EXIT_CODE, LaunchResult, parse_rank_failures, rank_exception, read_error_file,
)
from prefect_accelerate.launchers.state import (
    PRIVATE_FILE_MODE, make_private_dir, new_run_dir, remove_state, write_state,
)

#: seconds between SIGTERM and SIGKILL; below Prefect's 30 s so we finish before it kills us
GRACE_SECONDS = 20.0
#: how often the wait loop checks the deadline and looks for new descendants
POLL_SECONDS = 0.2
TAIL_LINES = 200

#: (label, line) -> None; label is "rank N" for rank-prefixed lines, else the launcher's name
LineCallback = Callable[[str, str], None]

_RANK_PREFIX = RANK_PREFIX


def split_rank(line: str, default: str, first_rank: int = 0) -> tuple[str, str]:
    """("rank 3", text) for torchrun's `[default3]:text` lines, else (default, line).

    torchrun prefixes each line with the worker's local rank; `first_rank` (this machine's rank times
    its process count) turns it into the global rank.
    """
    match = _RANK_PREFIX.match(line)
    if match:
        return f"rank {first_rank + int(match.group('rank'))}", line[match.end():]
    return default, line


class _Tracker:
    """Every process of the launch seen so far, with its start time (so a reused pid is never hit).

    That is the launcher's tree, and, with the supervisor a child subreaper (reaper.py), the orphans the
    kernel re-parents to us when a worker's helper double-forks or daemonizes, with their own trees.
    """

    def __init__(self, pid: int, launch_id: str = "") -> None:
        import psutil

        self.root = psutil.Process(pid)
        self.launch_id = launch_id
        self.seen: dict[int, float] = {pid: self.root.create_time()}

    def refresh(self) -> bool:
        import psutil

        from prefect_accelerate.launchers.reaper import adopted_children

        changed = False
        tops = [self.root, *(adopted_children(self.launch_id, set(self.seen)) if self.launch_id else [])]
        for top in tops:
            try:
                found = [top, *top.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for proc in found:
                try:
                    if proc.pid not in self.seen:
                        self.seen[proc.pid] = proc.create_time()
                        changed = True
                except psutil.NoSuchProcess:
                    continue
        return changed

    def alive(self, *, include_root: bool = True):
        import psutil

        procs = []
        for pid, started in self.seen.items():
            if pid == self.root.pid and not include_root:
                continue
            try:
                proc = psutil.Process(pid)
                if abs(proc.create_time() - started) < 0.05 and proc.status() != psutil.STATUS_ZOMBIE:
                    procs.append(proc)
            except psutil.NoSuchProcess:
                continue
        return procs

    def reap(self) -> None:
        from prefect_accelerate.launchers.reaper import reap_adopted

        reap_adopted(self.seen, exclude=self.root.pid)

    def as_records(self) -> list[dict[str, float | int]]:
        return [{"pid": pid, "create_time": started} for pid, started in self.seen.items()]


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the launcher leads its own session and group
    except (ProcessLookupError, PermissionError):
        pass


#: rounds of "find what is left, SIGTERM, SIGKILL": a daemon being stopped may start another process
STOP_ROUNDS = 3


def terminate_tree(process: subprocess.Popen, tracker: _Tracker, grace: float) -> None:
    """SIGTERM the launcher (it stops its workers), wait `grace`, then stop whatever is left: SIGTERM, a short
    wait, SIGKILL, for every process of the launch (adopted orphans included), and reap the adopted ones."""
    import psutil

    tracker.refresh()
    if process.poll() is None:
        _signal_group(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while process.poll() is None and time.monotonic() < deadline:
            tracker.refresh()
            time.sleep(0.05)
    if process.poll() is None:  # the grace is spent
        _signal_group(process.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)
    for _ in range(STOP_ROUNDS):
        tracker.refresh()
        # the launcher is Popen's to wait for: psutil's wait on it would take its exit status
        leftovers = tracker.alive(include_root=False)
        if not leftovers:
            break
        for proc in leftovers:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.terminate()
        _, leftovers = psutil.wait_procs(leftovers, timeout=min(grace, 3.0))
        for proc in leftovers:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(leftovers, timeout=5)
    _signal_group(process.pid, signal.SIGKILL)  # anything left in the launcher's group that we never saw
    tracker.reap()


def run_plan(
    plan: LaunchPlan,
    *,
    on_line: LineCallback | None = None,
    timeout: float | None = None,
    grace: float = GRACE_SECONDS,
    flow_run_id: str | None = None,
    task_run_id: str | None = None,
) -> LaunchResult:
    """Start the plan's command, stream its output, and make sure nothing it started outlives it.

    Args:
        plan: what to run.
        on_line: called with (label, line) for every output line (secrets redacted).
        timeout: wall-clock deadline in seconds; the tree is stopped and the result says timed_out.
        grace: seconds between SIGTERM and SIGKILL when stopping.
        flow_run_id, task_run_id: recorded in the state file for the cancellation hook.

    Returns:
        The LaunchResult (also for failures; call `raise_for_failure()`). Interrupts (Ctrl-C, SIGTERM,
        Prefect cancellation) stop the tree and are re-raised.
    """
    return start_plan(plan, on_line=on_line, flow_run_id=flow_run_id, task_run_id=task_run_id).wait(timeout=timeout, grace=grace)


@dataclasses.dataclass(eq=False)
class LaunchHandle:
    """A launch whose process tree is already running and whose output is already read (`start_plan`).

    `wait()` supervises it to the end (deadline, interrupts, the sweep of descendants) and returns its
    LaunchResult; call it in the main thread, where Ctrl-C, SIGTERM and Prefect's cancellation arrive.
    `stop()` ends it when nobody will wait (an interrupt came first). A Prefect run that takes the launch
    over records its ids with `record_run`, so the flow's on_cancellation/on_crashed hooks find it.
    """

    plan: LaunchPlan
    process: subprocess.Popen
    tracker: _Tracker
    run_dir: Path
    log_path: Path
    redact: Redactor
    first_rank: int
    tail: deque[str]
    command: str
    started: float
    launch_id: str
    state: dict
    stopping: threading.Event
    reader: threading.Thread
    #: what every output line went to (a retry on another port sends its lines there too)
    on_line: LineCallback | None
    #: ends the launch if this supervisor is killed -9; released when the launch is over (watchdog.py)
    watchdog: Any
    #: torchrun's per-rank log folder, when the plan has one
    log_dir: Path | None
    #: whether this launch holds the child-subreaper attribute (reaper.py), given back when it is over
    subreaper: bool = False
    finished: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        return self.process.poll() is None

    def record_run(self, flow_run_id: str | None, task_run_id: str | None) -> None:
        """Name the Prefect flow and task run that own this launch in its state file (launchers/state.py)."""
        self.state.update(flow_run_id=flow_run_id, task_run_id=task_run_id)
        if not self.finished:
            write_state(self.launch_id, {**self.state, "processes": self.tracker.as_records()})

    def wait(self, timeout: float | None = None, grace: float = GRACE_SECONDS) -> LaunchResult:
        """Supervise to the end; `timeout` counts from the start of the launch, not from this call."""
        return _supervise(self, timeout, grace)

    def stop(self, grace: float = GRACE_SECONDS) -> None:
        """End the whole tree now and clean up (idempotent); `wait()` is not called afterwards."""
        if not self.finished:
            _finish(self, grace)


def start_plan(
    plan: LaunchPlan,
    *,
    on_line: LineCallback | None = None,
    flow_run_id: str | None = None,
    task_run_id: str | None = None,
) -> LaunchHandle:
    """Start the plan's command and the reading of its output; return at once (see LaunchHandle)."""
    run_dir = make_private_dir(Path(plan.run_dir) if plan.run_dir else new_run_dir(), "run folder")
    for name, content in plan.files.items():
        target = Path(name) if os.path.isabs(name) else run_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        _write_private(target, content)
    log_path = run_dir / "launch.log"
    env = {**os.environ, **plan.env}
    redact = Redactor([value for name, value in env.items() if plan.is_secret(name)])
    label_default = plan.launcher
    first_rank = plan.machine_rank * (plan.num_processes // max(plan.num_machines, 1))
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    command = redact(plan.command_line())
    # unique per launch, even when a --run_dir is reused: a watchdog still ending an earlier launch of the same
    # folder must not recognise this one's processes as its own
    launch_id = f"{run_dir.name}-{os.getpid()}-{secrets.token_hex(3)}"
    log_dir = _log_dir(plan)
    _clear_stale_launches()
    env = _launch_env(plan, env, launch_id)
    watchdog = _start_watchdog(launch_id, run_dir, log_dir, env)
    # before anything starts: orphans of the launch are re-parented to us, not to PID 1 (held until _finish)
    subreaper = become_subreaper()
    started = time.monotonic()
    try:
        process = subprocess.Popen(
            _redacting_rank_logs(list(plan.argv)), cwd=plan.cwd, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=parent_death_hook(),
        )
    except BaseException as error:
        watchdog.release()
        if subreaper:
            release_subreaper()
        if isinstance(error, FileNotFoundError):
            raise LaunchError(
                f"Could not start {plan.argv[0]!r}: {error.strerror}. With --no_python the script must be an executable "
                f"file; otherwise check that the interpreter exists. Working directory: {plan.cwd}."
            ) from None
        if isinstance(error, PermissionError):
            raise LaunchError(f"{plan.argv[0]!r} is not executable. Make it executable (chmod +x) or drop --no_python.") from None
        raise

    tracker = _Tracker(process.pid, launch_id)
    state = {"pid": process.pid, "pgid": process.pid, "flow_run_id": flow_run_id, "task_run_id": task_run_id,
             "run_dir": str(run_dir), "log_dir": str(log_dir) if log_dir else None, "command": command,
             "started_at": time.time(), "supervisor": _supervisor_record()}
    write_state(launch_id, {**state, "processes": tracker.as_records()})

    stopping = threading.Event()

    def read_output() -> None:
        with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE_MODE), "a", encoding="utf-8") as log:
            assert process.stdout is not None
            for raw in iter(process.stdout.readline, b""):
                line = redact(raw.decode("utf-8", errors="replace").rstrip("\r\n"))
                log.write(line + "\n")
                log.flush()
                label, text = split_rank(line, label_default, first_rank)
                if stopping.is_set() and label == label_default and not text.startswith("[prefect-accelerate]"):
                    # torchrun's own SignalException traceback while we stop it: log file only (a runner of
                    # ours, such as the TPU pod runner, still says what it does while stopping)
                    continue
                tail.append(line)
                if on_line is not None:
                    try:
                        on_line(label, text)
                    except Exception:  # a broken callback must not stop the draining
                        pass

    reader = threading.Thread(target=contextvars.copy_context().run, args=(read_output,), name="launch-output", daemon=True)
    reader.start()
    return LaunchHandle(plan=plan, process=process, tracker=tracker, run_dir=run_dir, log_path=log_path, redact=redact,
                        first_rank=first_rank, tail=tail, command=command, started=started,
                        launch_id=launch_id, state=state, stopping=stopping, reader=reader, on_line=on_line,
                        watchdog=watchdog, log_dir=log_dir, subreaper=subreaper)


def _supervise(handle: LaunchHandle, timeout: float | None, grace: float) -> LaunchResult:
    process, tracker, launch_id, state, started = handle.process, handle.tracker, handle.launch_id, handle.state, handle.started
    timed_out = False
    exited = _exit_notice(process)
    try:
        with sigterm_as_exception():
            deadline = None if not timeout else started + timeout
            while process.poll() is None and not handle.finished:
                if tracker.refresh():
                    write_state(launch_id, {**state, "processes": tracker.as_records()})
                tracker.reap()
                if deadline is not None and time.monotonic() >= deadline:
                    timed_out = True
                    break
                pause = POLL_SECONDS if deadline is None else max(0.0, min(POLL_SECONDS, deadline - time.monotonic()))
                if exited is None:
                    time.sleep(pause)
                else:
                    select.select([exited], [], [], pause)  # wakes the moment the launcher exits
    finally:
        if exited is not None:
            os.close(exited)
        if not handle.finished:
            _finish(handle, grace)
    return _result(handle, timed_out)


def _exit_notice(process: subprocess.Popen) -> int | None:
    """A pidfd that turns readable when `process` exits (Linux 5.3+), so the wait loop ends at the exit instead of
    up to a poll interval later; None where the kernel or Python has none (the loop then sleeps)."""
    try:
        return os.pidfd_open(process.pid)
    except (AttributeError, OSError):  # no pidfd_open, or the process is already gone (poll() sees that)
        return None


def _finish(handle: LaunchHandle, grace: float) -> None:
    """Every path: normal exit (reap stragglers), deadline, error, Ctrl-C, SIGTERM, cancellation."""
    plan, process, run_dir, redact = handle.plan, handle.process, handle.run_dir, handle.redact
    handle.finished = True
    if process.poll() is None:
        handle.stopping.set()
    terminate_tree(process, handle.tracker, grace)
    handle.reader.join(timeout=10)
    # rank logs were redacted as written (ranklogs.py); torchrun's error files, and rank logs of a torchrun
    # without our LogsSpecs, are redacted here (issue 17)
    log_dir = handle.log_dir
    seal_folder(run_dir, redact)
    if log_dir is not None and run_dir not in log_dir.parents and log_dir != run_dir:
        seal_folder(log_dir, redact)
    remove_state(handle.launch_id)
    handle.watchdog.release()
    if handle.subreaper:
        handle.subreaper = False
        release_subreaper()


def _result(handle: LaunchHandle, timed_out: bool) -> LaunchResult:
    plan, process, run_dir, stopping, first_rank = handle.plan, handle.process, handle.run_dir, handle.stopping, handle.first_rank
    log_dir = _log_dir(plan)
    duration = time.monotonic() - handle.started
    code = process.returncode if process.returncode is not None else -9
    lines = list(handle.tail)
    failures, root_rank = parse_rank_failures(lines) if code != 0 else ([], None)
    message, error_code = read_error_file(run_dir / "error.json") if code != 0 else (None, None)
    if stopping.is_set() and message and message.startswith("SignalException"):
        message = None  # torchrun recording the SIGTERM we sent it: our own stop, not the training's error
    root_rank = _own_exception_rank(failures, root_rank)
    if code != 0 and log_dir is not None and root_rank is not None:
        # the worker's own exception (type, message, the user's frame) instead of torchrun's table
        own = rank_exception(log_dir, root_rank - first_rank)
        if own:
            # the closing lines are then the workers' own, not torchrun's failure table and traceback
            message, lines = own, [line for line in lines if RANK_PREFIX.match(line)] or lines
    worker_code = code
    if failures:
        worker_code = failures[0].exit_code
    elif error_code is not None:
        worker_code = error_code
    if worker_code < 0:  # killed by a signal: report it the shell's way
        worker_code = 128 - worker_code
    if timed_out:
        worker_code = TIMEOUT_EXIT_CODE
    return LaunchResult(
        launcher=plan.launcher, command=handle.command, exit_code=worker_code, launcher_exit_code=code,
        failed_ranks=failures, root_cause_rank=root_rank, error=message, duration_s=round(duration, 3), run_dir=str(run_dir),
        log_path=str(handle.log_path), tail=lines[-40:], timed_out=timed_out,
    )


def _launch_env(plan: LaunchPlan, env: dict[str, str], launch_id: str) -> dict[str, str]:
    """The launcher's environment: the plan's, plus the launch id every descendant inherits (how adopted
    orphans and, after a kill -9, the watchdog recognise them) and the names of the plan's own secrets
    (for the rank-log redactor inside torchrun)."""
    env = {**env, LAUNCH_ID_ENV: launch_id}
    marked = sorted(name for name in plan.secret_env if name in env)
    if marked:
        env[SECRET_NAMES_ENV] = ",".join(marked)
    return env


def _start_watchdog(launch_id: str, run_dir: Path, log_dir: Path | None, env: dict[str, str]) -> Watchdog:
    # the watchdog must not carry the launch id: it is not one of the processes it ends
    return Watchdog.start(launch_id, run_dir, log_dir, {k: v for k, v in env.items() if k != LAUNCH_ID_ENV})


def _supervisor_record() -> dict[str, float | int]:
    import psutil

    return {"pid": os.getpid(), "create_time": psutil.Process().create_time()}


def _clear_stale_launches() -> None:
    """Records of launches whose supervisor was killed (kill -9) before its watchdog could act: end what is left,
    redact their leftover logs, drop the records."""
    from prefect_accelerate.launchers.watchdog import clear_stale_launches

    with contextlib.suppress(Exception):  # never a reason not to start this launch
        clear_stale_launches()


#: torchrun's LogsSpecs entry point that writes per-rank logs through the redactor (launchers/ranklogs.py)
LOGS_SPECS = "prefect_accelerate"


def _redacting_rank_logs(argv: list[str]) -> list[str]:
    """torchrun's argv with `--logs_specs prefect_accelerate` when it writes per-rank logs and the interpreter
    running it has our entry point (this one); else unchanged (then the logs are sealed when the launch ends)."""
    if "torch.distributed.run" not in argv[:3] or "--log_dir" not in argv or argv[0] != sys.executable:
        return argv
    if not _has_logs_specs():  # (our flag table has no --logs_specs: the plan never names another one)
        return argv
    at = argv.index("torch.distributed.run") + 1
    return [*argv[:at], "--logs_specs", LOGS_SPECS, *argv[at:]]


def _has_logs_specs() -> bool:
    from importlib.metadata import entry_points

    return bool(entry_points(group="torchrun.logs_specs", name=LOGS_SPECS))


def _write_private(path: Path, content: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
    with open(fd, "w", encoding="utf-8") as handle:
        handle.write(content)


def _log_dir(plan: LaunchPlan) -> Path | None:
    """torchrun's --log_dir in the plan's command (where the per-rank stdout/stderr/error files go)."""
    argv = list(plan.argv)
    if "--log_dir" in argv[:-1]:
        return Path(plan.cwd, argv[argv.index("--log_dir") + 1])
    return None


def _own_exception_rank(failures, root_rank: int | None) -> int | None:
    """The rank whose exception to show: the first failure that was not a SIGTERM from torchrun."""
    for failure in failures:
        if failure.exit_code != -15:
            return failure.rank
    return root_rank
