"""Run a LaunchPlan as a supervised local process tree. No Prefect import: callers pass a line callback.

Facts this module is built on (spike-prefect-torch §3.1, §4.3, §4.4; prefect-and-peers §2.8):
- torchrun starts every worker in a session of its own, so a process-group signal never reaches them;
  SIGTERM to torchrun stops them within a second, while SIGKILL to torchrun orphans them.
- Prefect delivers cancellation as an exception in the main thread; `subprocess.run` answers any
  exception with SIGKILL. So: Popen, our own wait loop, and on every exit path SIGTERM to the launcher,
  a grace period shorter than Prefect's 30 s, then SIGKILL for the launcher and every descendant we saw.
- The launcher starts in its own session and its pids go to a state file, so a flow-level hook can
  end them if this process is killed before it could (launchers/state.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from prefect_accelerate.errors import LaunchError
from prefect_accelerate.signals import sigterm_as_exception
from prefect_accelerate.launchers.plan import LaunchPlan
from prefect_accelerate.secrets import Redactor
from prefect_accelerate.launchers.result import (
    RANK_PREFIX, TIMEOUT_EXIT_CODE, LaunchResult, parse_rank_failures, rank_exception, read_error_file,
)
from prefect_accelerate.launchers.state import (
    PRIVATE_DIR_MODE, PRIVATE_FILE_MODE, make_private_dir, new_run_dir, remove_state, write_state,
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
    """Every descendant of the launcher seen so far, with its start time (so a reused pid is never hit)."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.root = psutil.Process(pid)
        self.seen: dict[int, float] = {pid: self.root.create_time()}

    def refresh(self) -> bool:
        import psutil

        changed = False
        try:
            children = self.root.children(recursive=True)
        except psutil.NoSuchProcess:
            return False
        for child in children:
            try:
                if child.pid not in self.seen:
                    self.seen[child.pid] = child.create_time()
                    changed = True
            except psutil.NoSuchProcess:
                continue
        return changed

    def alive(self):
        import psutil

        procs = []
        for pid, started in self.seen.items():
            try:
                proc = psutil.Process(pid)
                if abs(proc.create_time() - started) < 0.05 and proc.status() != psutil.STATUS_ZOMBIE:
                    procs.append(proc)
            except psutil.NoSuchProcess:
                continue
        return procs

    def as_records(self) -> list[dict[str, float | int]]:
        return [{"pid": pid, "create_time": started} for pid, started in self.seen.items()]


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the launcher leads its own session and group
    except (ProcessLookupError, PermissionError):
        pass


def terminate_tree(process: subprocess.Popen, tracker: _Tracker, grace: float) -> None:
    """SIGTERM the launcher (it stops its workers), wait `grace`, then SIGKILL whatever is left."""
    import psutil

    tracker.refresh()
    if process.poll() is None:
        _signal_group(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while process.poll() is None and time.monotonic() < deadline:
            tracker.refresh()
            time.sleep(0.05)
    leftovers = tracker.alive()
    for proc in leftovers:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, leftovers = psutil.wait_procs(leftovers, timeout=min(grace, 3.0))
    _signal_group(process.pid, signal.SIGKILL)
    for proc in leftovers:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(leftovers, timeout=5)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


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
    started = time.monotonic()
    try:
        process = subprocess.Popen(
            list(plan.argv), cwd=plan.cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
    except FileNotFoundError as error:
        raise LaunchError(
            f"Could not start {plan.argv[0]!r}: {error.strerror}. With --no_python the script must be an executable "
            f"file; otherwise check that the interpreter exists. Working directory: {plan.cwd}."
        ) from None
    except PermissionError:
        raise LaunchError(f"{plan.argv[0]!r} is not executable. Make it executable (chmod +x) or drop --no_python.") from None

    tracker = _Tracker(process.pid)
    launch_id = run_dir.name
    state = {"pid": process.pid, "pgid": process.pid, "flow_run_id": flow_run_id, "task_run_id": task_run_id,
             "run_dir": str(run_dir), "command": command, "started_at": time.time()}
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
                        launch_id=launch_id, state=state, stopping=stopping, reader=reader, on_line=on_line)


def _supervise(handle: LaunchHandle, timeout: float | None, grace: float) -> LaunchResult:
    process, tracker, launch_id, state, started = handle.process, handle.tracker, handle.launch_id, handle.state, handle.started
    timed_out = False
    try:
        with sigterm_as_exception():
            deadline = None if not timeout else started + timeout
            while process.poll() is None and not handle.finished:
                if tracker.refresh():
                    write_state(launch_id, {**state, "processes": tracker.as_records()})
                if deadline is not None and time.monotonic() >= deadline:
                    timed_out = True
                    break
                time.sleep(POLL_SECONDS)
    finally:
        if not handle.finished:
            _finish(handle, grace)
    return _result(handle, timed_out)


def _finish(handle: LaunchHandle, grace: float) -> None:
    """Every path: normal exit (reap stragglers), deadline, error, Ctrl-C, SIGTERM, cancellation."""
    plan, process, run_dir, redact = handle.plan, handle.process, handle.run_dir, handle.redact
    handle.finished = True
    if process.poll() is None:
        handle.stopping.set()
    terminate_tree(process, handle.tracker, grace)
    handle.reader.join(timeout=10)
    remove_state(handle.launch_id)
    # torchrun's per-rank logs hold the workers' raw output: redact them like our own log (issue 17)
    log_dir = _log_dir(plan)
    seal_folder(run_dir, redact)
    if log_dir is not None and run_dir not in log_dir.parents and log_dir != run_dir:
        seal_folder(log_dir, redact)


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


def seal_folder(folder: Path, redact: Redactor) -> None:
    """Replace known secret values in every file under `folder`, and make it and them owner-only.

    Written files are torchrun's per-rank logs (the workers' raw output) and our own; each is rewritten
    line by line through `redact` only when a secret is in it.
    """
    if not folder.is_dir():
        return
    for root, dirs, files in os.walk(folder):
        with contextlib.suppress(OSError):
            os.chmod(root, PRIVATE_DIR_MODE)
        for name in files:
            path = Path(root, name)
            with contextlib.suppress(OSError):
                if path.is_symlink() or not path.is_file():
                    continue
                os.chmod(path, PRIVATE_FILE_MODE)
                _redact_file(path, redact)


def _redact_file(path: Path, redact: Redactor) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.redact")
    changed = False
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
    try:
        with open(path, encoding="utf-8", errors="surrogateescape", newline="") as source, \
                open(fd, "w", encoding="utf-8", errors="surrogateescape", newline="") as target:
            for line in source:  # streamed: per-rank logs can be large
                cleaned = redact(line)
                changed = changed or cleaned != line
                target.write(cleaned)
        if changed:
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
