"""Nothing outlives a launch (issue 27), over random stops, timings and kill points, with real torchrun (gloo, CPU).

Each worker starts helpers that leave its tree (`setsid -f` and a classic double-fork daemon) and writes
every pid to a file; after each stop the test polls until all of them are gone. The same launches are
watched by a thread that reads every file of the state folder over and over while a worker prints a
secret-valued variable: no raw secret may be on disk at any moment, and nothing may be readable by others.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from helpers.processes import assert_all_gone, read_pids, wait_for_pids

from prefect_accelerate.launchers.reaper import LAUNCH_ID_ENV

REPO = Path(__file__).resolve().parents[2]
WORKER = str(REPO / "tests" / "launchers" / "scripts" / "detaching_worker.py")
CLI = [sys.executable, "-m", "prefect_accelerate.cli.main", "launch", "--no-track", "--cpu", "--num_processes", "2",
       "--mixed_precision", "no", "--num_machines", "1", "--dynamo_backend", "no", "--main_process_port", "0"]
SECRET = "hf_" + "Zq8" * 8 + "raw-secret"
#: processes per launch once every helper is up: 2 workers, each with a setsid helper and a daemon
EVERY_PID = 6
TRIALS = settings(max_examples=6, deadline=None, phases=[Phase.generate], database=None,
                  suppress_health_check=list(HealthCheck))

pytestmark = pytest.mark.slow


class DiskWatcher:
    """Reads every file under `root` in a loop; records any raw secret and anything others could read."""

    def __init__(self, root: Path) -> None:
        self.root, self.found, self.readable = root, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.scans = 0

    def __enter__(self) -> DiskWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._scan()  # once more, after the launch ended

    def _run(self) -> None:
        while not self._stop.is_set():
            self._scan()
            time.sleep(0.01)

    def _scan(self) -> None:
        """One pass. Folders: the state folder, runs/ and the run folder are owner-only whenever they exist, so
        nothing below them can be reached by others. Files: every output log is owner-only from creation
        (torch's own error.json files keep torch's mode until the launch seals them: the final check)."""
        self.scans += 1
        for folder in (self.root, self.root / "runs", *self.root.glob("runs/*"), self.root / "launches"):
            with contextlib.suppress(OSError):
                if folder.is_dir() and stat.S_IMODE(folder.stat().st_mode) != 0o700:
                    self.readable.append(f"{folder} {oct(stat.S_IMODE(folder.stat().st_mode))}")
        for folder, _, files in os.walk(self.root):
            for name in files:
                path = Path(folder, name)
                try:
                    info = path.lstat()
                    if stat.S_ISREG(info.st_mode) and name.endswith(".log") and info.st_mode & 0o077:
                        self.readable.append(f"{path} {oct(info.st_mode & 0o777)}")
                    if stat.S_ISREG(info.st_mode) and SECRET.encode() in path.read_bytes():
                        self.found.append(str(path))
                except OSError:
                    continue

    def check(self) -> None:
        assert self.scans > 3
        assert not self.found, f"raw secret on disk in {sorted(set(self.found))}"
        assert not self.readable, f"files others can read: {sorted(set(self.readable))}"
        for path, folders, files in os.walk(self.root):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o700, path
            for name in files:
                assert stat.S_IMODE(os.lstat(Path(path, name)).st_mode) & 0o077 == 0, Path(path, name)


def launch_env(tmp: Path, **extra: str) -> dict[str, str]:
    (tmp / "pids").mkdir(parents=True, exist_ok=True)
    return {**os.environ, "PIDDIR": str(tmp / "pids"), "HF_TOKEN": SECRET, "PRINT_SECRET": "HF_TOKEN",
            "PREFECT_ACCELERATE_STATE_DIR": str(tmp / "state"), **extra}


def launch_processes(run_name: str) -> list[psutil.Process]:
    """Live processes whose launch id (run folder name, pid, random part) belongs to the run folder `run_name`."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(LAUNCH_ID_ENV, "").startswith(f"{run_name}-"):
                found.append(proc)
    return found


def assert_launch_gone(tmp: Path, run_name: str, timeout: float) -> None:
    """Within `timeout`: every pid the workers and their helpers wrote is gone, and so is every process carrying
    the launch's id (torchrun included)."""
    deadline = time.monotonic() + timeout
    assert_all_gone(read_pids(tmp / "pids"), timeout=timeout)
    while launch_processes(run_name) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not launch_processes(run_name), f"processes of {run_name} still alive"


@TRIALS
@given(stop=st.sampled_from(["sigterm", "ctrl-c", "timeout", "normal end", "exception"]),
       delay=st.floats(0.0, 1.5), detach=st.sampled_from(["setsid,daemon", "daemon", "setsid"]))
def test_no_descendant_survives_any_stop(tmp_path_factory, stop, delay, detach):
    """SIGTERM, Ctrl-C to the CLI's group, --timeout, a normal end with daemons left behind, and an exception in
    the supervisor's main thread (how Prefect delivers cancellation): every helper is gone after each."""
    tmp = tmp_path_factory.mktemp("stop")
    env = launch_env(tmp, DETACH=detach, WORKER_SLEEP="2" if stop == "normal end" else "600")
    expected = 2 * (1 + len(detach.split(",")))
    run_dir = tmp / "state" / "runs" / "launch-under-test"
    if stop == "exception":
        argv = [sys.executable, "-c", EXCEPTION_DRIVER, WORKER, str(run_dir)]
    else:
        argv = [*CLI, "--run_dir", str(run_dir), *(["--timeout", "20"] if stop == "timeout" else []), WORKER]
    with DiskWatcher(tmp / "state") as watcher:
        # SIGINT as a terminal gives it: a suite started in the background (`./dev test &`) has SIGINT ignored,
        # and a child inherits that
        cli = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            wait_for_pids(tmp / "pids", expected)
            time.sleep(delay)
            if stop == "sigterm":
                cli.send_signal(signal.SIGTERM)
            elif stop == "ctrl-c":
                os.killpg(cli.pid, signal.SIGINT)  # what a terminal sends to its foreground group
            elif stop == "exception":
                cli.send_signal(signal.SIGUSR1)
            out, err = cli.communicate(timeout=120)
        finally:
            if cli.poll() is None:
                cli.kill()
    expected_codes = {"sigterm": {143}, "ctrl-c": {130}, "timeout": {124}, "normal end": {0}, "exception": {3}}[stop]
    assert cli.returncode in expected_codes, (stop, cli.returncode, err[-2000:])
    assert len(read_pids(tmp / "pids")) == expected
    # gone at once: the supervisor waited for them before it returned
    assert_launch_gone(tmp, run_dir.name, timeout=2)
    assert not list((tmp / "state" / "launches").glob("*.json"))
    assert SECRET not in out + err
    watcher.check()


#: a supervisor whose main thread gets an exception mid-launch, as Prefect's cancellation does
EXCEPTION_DRIVER = """
import signal, sys
from prefect_accelerate.launchers import plan_launch
from prefect_accelerate.launchers.options import build_launch_options
from prefect_accelerate.launchers.process import run_plan

class Cancelled(Exception):
    pass

def cancel(signum, frame):
    raise Cancelled()

signal.signal(signal.SIGUSR1, cancel)
options = build_launch_options(sys.argv[1], cpu=True, num_processes=2, mixed_precision="no", num_machines=1,
                               dynamo_backend="no", main_process_port=0, run_dir=sys.argv[2])
try:
    run_plan(plan_launch(options), grace=5)
except Cancelled:
    sys.exit(3)
"""


@settings(max_examples=3, deadline=None, phases=[Phase.generate], database=None, suppress_health_check=list(HealthCheck))
@given(kill_after=st.floats(0.0, 2.0), before_helpers=st.booleans())
def test_no_worker_is_alive_10_s_after_a_kill_9_of_the_supervisor(tmp_path_factory, kill_after, before_helpers):
    """kill -9 of the CLI at a random moment (while the workers start their helpers, or after): 10 s later
    nothing of the launch runs, no record is left, and no raw secret is on disk."""
    tmp = tmp_path_factory.mktemp("kill9")
    env = launch_env(tmp)
    run_dir = tmp / "state" / "runs" / "launch-killed"
    with DiskWatcher(tmp / "state") as watcher:
        cli = subprocess.Popen([*CLI, "--run_dir", str(run_dir), WORKER], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
        wait_for_pids(tmp / "pids", 1 if before_helpers else EVERY_PID)
        time.sleep(kill_after)
        cli.kill()
        cli.wait()
        killed = time.monotonic()
        assert_launch_gone(tmp, run_dir.name, timeout=10)
        assert time.monotonic() - killed <= 10.5
        deadline = time.monotonic() + 10
        while list((tmp / "state" / "launches").glob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not list((tmp / "state" / "launches").glob("*.json")), "the watchdog left the stale record"
    watcher.check()


def test_the_next_launch_clears_a_stale_record_and_redacts_leftover_logs(tmp_path):
    """A supervisor and its watchdog both killed -9: the next launch ends what is left, redacts the old run's logs
    with this environment's secret values, and removes the record."""
    env = launch_env(tmp_path, PRINT_SECRET="")
    run_dir = tmp_path / "state" / "runs" / "launch-orphaned"
    cli = subprocess.Popen([*CLI, "--run_dir", str(run_dir), WORKER], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for_pids(tmp_path / "pids", EVERY_PID)
    watchdog = [p for p in psutil.Process(cli.pid).children() if "launchers.watchdog" in " ".join(p.cmdline())]
    assert len(watchdog) == 1
    watchdog[0].kill()
    cli.kill()
    cli.wait()
    leftover = run_dir / "left-behind.log"
    leftover.write_text(f"a line with {SECRET}\n")  # as a torchrun without our LogsSpecs would have left it
    assert list((tmp_path / "state" / "launches").glob("*.json"))
    script = tmp_path / "ok.py"
    script.write_text("print('fine')\n")
    done = subprocess.run([sys.executable, "-m", "prefect_accelerate.cli.main", "launch", "--no-track", "--cpu",
                           "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                           str(script)], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert_launch_gone(tmp_path, run_dir.name, timeout=10)
    assert not list((tmp_path / "state" / "launches").glob("*.json"))
    assert SECRET not in leftover.read_text() and "***" in leftover.read_text()
    assert stat.S_IMODE(leftover.stat().st_mode) == 0o600


def test_adopted_orphans_of_other_callers_are_left_alone(tmp_path):
    """The subreaper adopts every orphan below this process; a launch stops only those carrying its own id."""
    from prefect_accelerate.launchers.process import run_plan
    from prefect_accelerate.launchers.plan import LaunchPlan
    from prefect_accelerate.launchers.reaper import become_subreaper, release_subreaper

    assert become_subreaper()  # held across the other caller's detach and the launch, as in a launch's window
    try:
        _orphans_of_others_are_left_alone(tmp_path, run_plan, LaunchPlan)
    finally:
        release_subreaper()


def _orphans_of_others_are_left_alone(tmp_path, run_plan, LaunchPlan):
    pid_file = tmp_path / "other.pid"
    subprocess.run(["setsid", "-f", sys.executable, "-c", "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); "
                    "time.sleep(600)", str(pid_file)], check=True, env={k: v for k, v in os.environ.items() if k != LAUNCH_ID_ENV})
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    other = psutil.Process(int(pid_file.read_text()))
    try:
        assert other.ppid() == os.getpid()  # adopted by this process, the subreaper
        plan = LaunchPlan(launcher="simple", argv=(sys.executable, "-c", "print('hi')"), env={}, cwd=str(tmp_path),
                          num_processes=1, num_machines=1, machine_rank=0, run_dir=str(tmp_path / "run"))
        assert run_plan(plan).succeeded
        assert other.is_running() and other.status() != psutil.STATUS_ZOMBIE
    finally:
        other.kill()
        other.wait(timeout=10)  # our child now: reaped here


def test_adopted_helpers_that_end_are_reaped_not_left_as_zombies(tmp_path):
    """A detached helper that ends during the launch is collected by the supervisor (its subreaper parent), and a
    zombie of a child this process started otherwise is left to its own Popen."""
    from prefect_accelerate.launchers.plan import LaunchPlan
    from prefect_accelerate.launchers.process import run_plan

    other = subprocess.Popen([sys.executable, "-c", "pass"])  # someone else's child: its status is Popen's
    deadline = time.monotonic() + 60
    while psutil.Process(other.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    script = tmp_path / "brief_helpers.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "for _ in range(3):\n"
        "    subprocess.run(['setsid', '-f', sys.executable, '-c', 'import time; time.sleep(1)'], check=True)\n"
        "time.sleep(3)\n"
    )
    plan = LaunchPlan(launcher="simple", argv=(sys.executable, str(script)), cwd=str(tmp_path), run_dir=str(tmp_path / "run"))
    def zombies() -> set[int]:
        return {p.pid for p in psutil.Process().children() if p.status() == psutil.STATUS_ZOMBIE}

    before = zombies()  # other.pid, and whatever earlier tests of this session left for their own Popens
    assert run_plan(plan).succeeded
    assert zombies() == before and other.pid in before
    assert other.wait(timeout=10) == 0  # its exit status was not taken by the launch's reaping


PDEATH_DRIVER = """
import subprocess, sys, time
from prefect_accelerate.launchers.reaper import parent_death_hook
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], preexec_fn=parent_death_hook())
print(child.pid, flush=True)
time.sleep(600)
"""


def test_the_launcher_gets_sigterm_as_soon_as_its_supervisor_dies():
    """The parent-death signal on its own (no watchdog here): kill -9 of the starting process ends its child."""
    driver = subprocess.Popen([sys.executable, "-c", PDEATH_DRIVER], stdout=subprocess.PIPE, text=True)
    child = int(driver.stdout.readline())
    assert psutil.pid_exists(child)
    driver.kill()
    driver.wait()
    assert_all_gone([child], timeout=10)


def test_the_subreaper_attribute_is_held_only_while_a_launch_runs(tmp_path):
    """A long-lived process (a notebook, a worker, this test session) is a subreaper only during its launches, so it
    does not adopt, and then keep as zombies, the orphans of everything else it runs."""
    from prefect_accelerate.launchers.plan import LaunchPlan
    from prefect_accelerate.launchers.process import start_plan
    from prefect_accelerate.launchers.reaper import _subreaper_in_force

    assert not _subreaper_in_force()
    plan = LaunchPlan(launcher="simple", argv=(sys.executable, "-c", "import time; time.sleep(1)"), cwd=str(tmp_path),
                      run_dir=str(tmp_path / "run"))
    handle = start_plan(plan)
    assert _subreaper_in_force()
    assert handle.wait().succeeded
    assert not _subreaper_in_force()
