"""The long-lived local Prefect server and tracking that never costs the training, with real processes:
real `prefect server` processes under private PREFECT_HOMEs, real torchrun launches, real signals.

Start-ups are kept few: the signal and concurrency tests use the session's server (tests/conftest.py, found
by the commands through its record), one fresh PREFECT_HOME proves the lock and the reuse and is then killed
under a running launch; a failing server and one per-command server cost one start each.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers.processes import assert_all_gone, read_pids, wait_for_pids
from prefect_accelerate import localserver

pytestmark = pytest.mark.slow
WORKER = str(Path(__file__).resolve().parent.parent / "launchers" / "scripts" / "worker.py")
CLI = [sys.executable, "-m", "prefect_accelerate.cli.main"]
LAUNCH = [*CLI, "launch", "--cpu", "--num_processes", "2", "--mixed_precision", "no", "--num_machines", "1", "--dynamo_backend", "no"]
STEPS = """\
import os, sys, time
for step in range(int(sys.argv[1])):
    print(f"step {step} of rank {os.environ['RANK']}", flush=True)
    time.sleep(float(sys.argv[2]))
sys.exit(int(sys.argv[3]))
"""

# writes its pid, then runs until the local server's keeper has given up (record "failed", or removed after it existed)
UNTIL_FAILED = """\
import json, os, time
from pathlib import Path

rank = os.environ["RANK"]
Path(os.environ["WORKER_PID_DIR"], f"{rank}.pid").write_text(str(os.getpid()))
record = Path(os.environ["PREFECT_HOME"], "prefect-accelerate", "server.json")
seen, deadline = False, time.monotonic() + 600
while time.monotonic() < deadline:
    try:
        state = json.loads(record.read_text()).get("state")
        seen = True
    except (OSError, ValueError):
        state = None
    if state == "failed" or (seen and state is None):
        break
    time.sleep(0.1)
print(f"rank {rank} saw the server fail", flush=True)
time.sleep(3)  # time for the command to hear it too
"""


def env_for(home: Path, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(home), PREFECT_ACCELERATE_STATE_DIR=str(tmp_path / "state"), COLUMNS="200", **extra)
    return env


def server_processes(home: Path) -> list[psutil.Process]:
    """Every `prefect server start` running with this PREFECT_HOME."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmd = proc.info["cmdline"] or []
            guard = "prefect_accelerate.localserver.guard" in cmd  # the per-command server's guard names it
            if not guard and "server" in cmd and "start" in cmd and any(part.endswith("prefect") for part in cmd) \
                    and proc.environ().get("PREFECT_HOME") == str(home):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def flow_runs(url: str, flow_name: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def read():
        async with get_client() as client:
            return await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])))

    with temporary_settings(updates={PREFECT_API_URL: url}):
        return asyncio.run(read())


def run_logs(url: str, flow_run_id: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def read():
        async with get_client() as client:
            return await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))

    with temporary_settings(updates={PREFECT_API_URL: url}):
        return "\n".join(log.message for log in asyncio.run(read()))


def no_traceback_of_ours(err: str) -> bool:
    """No traceback of this command's own on its stderr. The training's output, torchrun's own traceback after a
    failed rank included, goes to stdout as it comes, tracked or not (issue 24); on stderr, a traceback inside a
    Prefect log line labelled by the launcher or a rank is still the training's."""
    return all("[torchrun]" in line or "[rank" in line for line in err.splitlines() if "Traceback" in line)


@pytest.fixture(scope="module")
def fresh_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-home")
    yield home
    localserver.stop_server(home)


def test_commands_started_together_start_exactly_one_server_and_later_ones_reuse_it(fresh_home, tmp_path):
    env = env_for(fresh_home, tmp_path)
    commands = [subprocess.Popen([*CLI, "env", "--track", "--no_import_check"], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [command.communicate(timeout=600) for command in commands]
    assert [c.returncode for c in commands] == [0, 0, 0], [err[-2000:] for _, err in outputs]
    started = [err for _, err in outputs if "Started a local Prefect server" in err]
    assert len(started) == 1, [err[-1500:] for _, err in outputs]
    record = localserver.read_record(fresh_home)
    assert record is not None and record.state == "ready" and record.ui_url in started[0] and "server stop" in started[0]
    assert [p.pid for p in server_processes(fresh_home)] == [record.pid]
    # the server lives in a session of its own: a Ctrl-C in the terminal of a command never reaches it
    assert os.getsid(record.pid) == record.keeper_pid != os.getsid(0)
    # its database (run parameters, logs) and log are the user's only (issue 27)
    assert stat.S_IMODE((fresh_home / "prefect.db").stat().st_mode) == 0o600
    assert stat.S_IMODE((localserver.files_dir(fresh_home) / "server.log").stat().st_mode) == 0o600
    runs = flow_runs(record.url, "env")
    assert len(runs) == 3 and all(run.state.is_completed() for run in runs)

    status = subprocess.run([*CLI, "server", "status"], env=env, capture_output=True, text=True, timeout=120)
    assert status.returncode == 0 and f"pid {record.pid}" in status.stdout and "answering" in status.stdout
    again = subprocess.run([*CLI, "env", "--no_import_check", "--track"], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "Started" not in again.stderr
    assert localserver.read_record(fresh_home).pid == record.pid and len(flow_runs(record.url, "env")) == 4


def test_a_launch_outlives_its_server_and_a_stale_record_is_replaced(fresh_home, tmp_path):
    env = env_for(fresh_home, tmp_path)
    # started (or found) by a command of its own: this test process must not hold the server in use
    assert subprocess.run([*CLI, "server", "start"], env=env, capture_output=True, timeout=600).returncode == 0
    record = localserver.read_record(fresh_home)
    script = tmp_path / "steps.py"
    script.write_text(STEPS)
    known = {run.id for run in flow_runs(record.url, "launch")}
    launch = subprocess.Popen([*LAUNCH, str(script), "12", "1", "3"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_running(record.url, known)  # the training starts before its run exists (issue 24): lost once both do
    time.sleep(2)
    for pid in (record.keeper_pid, record.pid):  # the whole server goes away, as after an OOM kill
        os.kill(pid, signal.SIGKILL)
    out, err = launch.communicate(timeout=300)
    assert launch.returncode == 3, err[-3000:]  # the training's own exit code
    assert "stopped answering during the launch" in err and no_traceback_of_ours(err), err[-3000:]
    assert "step 11 of rank 0" in out + err and "step 11 of rank 1" in out + err  # the console kept every line
    logs = list((tmp_path / "state" / "runs").glob("*/launch.log"))
    assert len(logs) == 1 and "step 11 of rank 1" in logs[0].read_text()  # and so did the run folder

    status = subprocess.run([*CLI, "server", "status"], env=env, capture_output=True, text=True, timeout=120)
    assert status.returncode == 1 and "is gone" in status.stdout
    # the next command replaces the stale record; this one is told to stop after 3 s unused
    start = subprocess.run([*CLI, "server", "start"], env={**env, localserver.IDLE_ENV: "0.05"}, capture_output=True, text=True, timeout=600)
    assert start.returncode == 0 and start.stdout.startswith("Started"), start.stdout + start.stderr
    fresh = localserver.read_record(fresh_home)
    assert fresh is not None and fresh.pid != record.pid and localserver.healthy(fresh.url)
    assert_all_gone([fresh.pid, fresh.keeper_pid], timeout=120)  # unused: stopped by its keeper
    assert localserver.read_record(fresh_home) is None


def test_no_server_in_time_runs_untracked_and_explicit_track_exits_2(tmp_path):
    home = tmp_path / "home"
    # a database that cannot be created: Prefect's server starts, fails its start-up and exits
    env = env_for(home, tmp_path, PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{tmp_path}/missing/dir/prefect.db",
                  WORKER_PID_DIR=str(tmp_path / "pids"))
    (tmp_path / "pids").mkdir()
    # the training starts at once (issue 24) and here runs until the server has failed, so the command learns it
    script = tmp_path / "until_failed.py"
    script.write_text(UNTIL_FAILED)
    done = subprocess.run([*LAUNCH, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Tracking is not available: the local Prefect server" in done.stderr and "Running untracked" in done.stderr
    assert "PREFECT_API_URL" in done.stderr and "server start" in done.stderr and "--no-track" in done.stderr
    assert "[rank 1] rank 1 saw the server fail" in done.stdout and "Traceback" not in done.stderr
    assert len(read_pids(tmp_path / "pids")) == 2 and localserver.read_record(home) is None

    for pid_file in (tmp_path / "pids").iterdir():
        pid_file.unlink()
    closed = f"http://127.0.0.1:{_closed_port()}/api"
    for extra, argv in (({"PREFECT_API_URL": closed}, [*LAUNCH, "--track", WORKER]),
                        ({"PREFECT_API_URL": closed, "PREFECT_ACCELERATE_TRACK": "always"}, [*LAUNCH, WORKER])):
        refused = subprocess.run(argv, env={**env, **extra}, capture_output=True, text=True, timeout=300)
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert "\nerror: Tracking is not available" in "\n" + refused.stderr and closed in refused.stderr
        assert "nothing was started" in refused.stderr and "Traceback" not in refused.stderr
        assert read_pids(tmp_path / "pids") == []  # no training process started


def _end(process: subprocess.Popen) -> None:
    """A command a failed assertion left running: SIGTERM (it ends its own training processes), then SIGKILL."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_running(url: str, known: set, timeout: float = 300) -> None:
    """Until a launch flow run not in `known` is Running."""
    deadline = time.monotonic() + timeout
    while not any(run.id not in known and run.state.is_running() for run in flow_runs(url, "launch")):
        assert time.monotonic() < deadline, "the launch's flow run never started running"
        time.sleep(0.2)


def _latest_state(url: str, flow_name: str) -> tuple[str, str]:
    run = max(flow_runs(url, flow_name), key=lambda r: r.created)
    return run.state.type.value, run.state.message or ""


@pytest.mark.parametrize(("how", "code", "final", "reason"), [
    ("sigint-group", 130, "CRASHED", "interrupt signal"),
    ("sigterm", 143, "CRASHED", "termination signal"),
    ("timeout", 124, "CANCELLED", "deadline (--timeout)"),
])
def test_a_signal_or_the_deadline_ends_every_process_and_the_run_with_the_reason(prefect_harness, session_root, tmp_path, how, code, final, reason):
    env = env_for(session_root / "prefect-home", tmp_path, WORKER_MODE="sleep", WORKER_PID_DIR=str(tmp_path / "pids"))
    (tmp_path / "pids").mkdir()
    before = {p.pid for p in server_processes(session_root / "prefect-home")}
    # a group of its own, as a terminal's foreground job; SIGINT as a shell gives it (a test run in the
    # background of a shell would hand down SIGINT ignored)
    deadline = ["--timeout", "15"] if how == "timeout" else []
    known = {run.id for run in flow_runs(prefect_harness.url, "launch")}
    cli = subprocess.Popen([*LAUNCH, "--grace_period", "5", *deadline, WORKER], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        workers = wait_for_pids(tmp_path / "pids", 2)
        if how != "timeout":  # the training starts before its run exists (issue 24): the signal comes once both do
            _wait_running(prefect_harness.url, known)
        tree = [p.pid for p in psutil.Process(cli.pid).children(recursive=True)]
        began = time.monotonic()
        if how == "sigint-group":
            os.killpg(cli.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        elif how == "sigterm":
            cli.send_signal(signal.SIGTERM)
        out, err = cli.communicate(timeout=120)
    finally:
        _end(cli)
    assert cli.returncode == code, err[-3000:]
    # done within the grace period plus a few seconds of the signal, or of the deadline (15 s from the start)
    assert time.monotonic() - began < (15 if how == "timeout" else 0) + 5 + 30, "not within the grace period plus a few seconds"
    stopped = "did not finish within its deadline" if how == "timeout" else "every process the command started was stopped"
    assert stopped in err and no_traceback_of_ours(err), err[-3000:]
    assert_all_gone([*workers, *tree], timeout=30)
    state, message = _latest_state(prefect_harness.url, "launch")
    assert state == final and reason in message, (state, message)
    assert {p.pid for p in server_processes(session_root / "prefect-home")} == before  # the shared server stays


def test_four_tracked_launches_and_a_validate_at_once_all_run_and_are_recorded(prefect_harness, session_root, tmp_path):
    env = env_for(session_root / "prefect-home", tmp_path)
    config = tmp_path / "cpu.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nmixed_precision: 'no'\nnum_machines: 1\n"
                      "num_processes: 2\nuse_cpu: true\n")
    before = len(flow_runs(prefect_harness.url, "launch"))
    launches = [subprocess.Popen([*LAUNCH, "--run_dir", str(tmp_path / f"run{i}"), WORKER], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for i in range(4)]
    validate = subprocess.Popen([*CLI, "validate", str(config), "--no_install_test"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    results = [(p, *p.communicate(timeout=900)) for p in [*launches, validate]]
    for proc, out, err in results:
        assert proc.returncode == 0, err[-3000:]
        assert "sqlalchemy" not in err.lower() and "database is locked" not in err.lower(), err[-3000:]
        assert no_traceback_of_ours(err), err[-3000:]
    runs = [r for r in flow_runs(prefect_harness.url, "launch")]
    assert len(runs) == before + 4 and all(r.state.is_completed() for r in sorted(runs, key=lambda r: r.created)[-4:])
    for run in sorted(runs, key=lambda r: r.created)[-4:]:
        assert "sum 3.0" in run_logs(prefect_harness.url, str(run.id))
    assert any(r.state.is_completed() for r in flow_runs(prefect_harness.url, "validate-configs"))


def _wait_for_servers(home: Path, cli: subprocess.Popen, timeout: float) -> list[int]:
    """The pids of the servers running with this PREFECT_HOME once there is one (or the command ended, or time ran out)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [p.pid for p in server_processes(home)]
        if found or cli.poll() is not None or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_a_per_command_server_ends_with_the_command_even_on_sigterm(tmp_path):
    home = tmp_path / "home"
    env = env_for(home, tmp_path, WORKER_MODE="sleep", WORKER_PID_DIR=str(tmp_path / "pids"), PREFECT_ACCELERATE_SERVER="ephemeral")
    (tmp_path / "pids").mkdir()
    cli = subprocess.Popen([*LAUNCH, "--grace_period", "5", WORKER], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        workers = wait_for_pids(tmp_path / "pids", 2, timeout=600)
        # the server is searched for in a thread while the training starts (cli/tracking.py's ServerSearch): on a
        # loaded machine the workers can be up before that thread has started the server, so wait for it
        servers = _wait_for_servers(home, cli, timeout=120)
        if not servers:  # say why: what the command printed about its server
            _end(cli)
            pytest.fail(f"no per-command server ran with this PREFECT_HOME; the command said: {cli.communicate()[1][-3000:]}")
        tree = [p.pid for p in psutil.Process(cli.pid).children(recursive=True)]
        assert len(servers) == 1 and servers[0] in tree and os.getsid(servers[0]) != os.getsid(cli.pid)
        cli.send_signal(signal.SIGTERM)
        _, err = cli.communicate(timeout=120)
    finally:
        _end(cli)
    assert cli.returncode == 143 and no_traceback_of_ours(err), err[-3000:]
    assert_all_gone([*workers, *tree], timeout=30)
    assert localserver.read_record(home) is None  # nothing long-lived was started


def test_a_per_command_server_outlives_the_search_thread_and_ends_when_its_command_is_killed_9(tmp_path):
    """The per-command server is started from the search thread, which ends once the server answers; it must live
    on (a parent death signal, sent when that thread ended, stopped it: the launch was never recorded) and record
    the launch. When the command is killed with SIGKILL, no `finally` runs: its guard sees the pipe close and ends
    the server, and the launch's watchdog its workers."""
    home = tmp_path / "home"
    env = env_for(home, tmp_path, WORKER_MODE="sleep", WORKER_PID_DIR=str(tmp_path / "pids"), PREFECT_ACCELERATE_SERVER="ephemeral")
    (tmp_path / "pids").mkdir()
    cli = subprocess.Popen([*LAUNCH, WORKER], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        workers = wait_for_pids(tmp_path / "pids", 2, timeout=600)
        servers = _wait_for_servers(home, cli, timeout=120)
        assert len(servers) == 1, "no per-command server"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (_listening_port(servers[0]) and
                                                   localserver.healthy(f"http://127.0.0.1:{_listening_port(servers[0])}/api")):
            time.sleep(0.2)
        tree = [p.pid for p in psutil.Process(cli.pid).children(recursive=True)]
        time.sleep(3)  # it answered, so the search thread has ended: the server still runs and answers
        assert psutil.Process(servers[0]).status() != psutil.STATUS_ZOMBIE
        assert localserver.healthy(f"http://127.0.0.1:{_listening_port(servers[0])}/api")
        cli.kill()
        cli.wait(timeout=30)
    finally:
        _end(cli)
    assert_all_gone([*workers, *tree], timeout=30)


def _listening_port(pid: int) -> int | None:
    try:
        return next((c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN), None)
    except psutil.Error:
        return None


def test_a_per_command_server_whose_port_is_taken_before_it_binds_starts_on_another(tmp_path, monkeypatch):
    """The port is picked, then bound seconds later by `prefect server start`. Here another listener holds the first
    port meanwhile, and answers the health check as another Prefect server would: that answer is not taken for
    ours (the kernel's socket table says who listens), our server fails to bind and exits, and it is started again
    on another port, which is returned."""
    import http.server
    import threading

    from prefect_accelerate.localserver import ephemeral

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the handler's API
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"true")

        def log_message(self, *args) -> None:
            pass

    squatter = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    taken = squatter.server_address[1]
    picks = iter([taken])
    monkeypatch.setattr(ephemeral, "_free_port", lambda: next(picks, None) or localserver._free_port())
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "home"))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        url = ephemeral.start_ephemeral(timeout=240)
        assert localserver.healthy(url) and f":{taken}/" not in url
        ours = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]
        guards = [p for p in ours if "prefect_accelerate.localserver.guard" in p.cmdline()]
        # one guard and its server: the first server, which lost its port, is gone with its guard
        assert len(ours) == 2 and len(guards) == 1 and localserver.listens(guards[0].pid, int(url.split(":")[2].split("/")[0]))
    finally:
        squatter.shutdown()
        squatter.server_close()
        for process in psutil.Process().children(recursive=True):
            if process.pid not in before:
                process.terminate()
    assert_all_gone([process.pid for process in ours], timeout=30)


def test_the_record_of_a_server_is_read_safely_whatever_the_file_holds(tmp_path):
    from hypothesis import given, settings, strategies as st

    home = tmp_path / "home"
    path = localserver.record_path(home)
    path.parent.mkdir(parents=True)

    @settings(max_examples=150, deadline=None)
    @given(st.one_of(st.binary(max_size=200), st.dictionaries(st.text(max_size=12), st.one_of(st.integers(), st.text(max_size=20), st.none()),
                                                           max_size=6).map(lambda d: json.dumps(d).encode())))
    def check(content: bytes) -> None:
        path.write_bytes(content)
        record = localserver.read_record(home)
        assert record is None or isinstance(record, localserver.ServerRecord)
        if record is not None:
            localserver.is_running(record)  # never raises on odd pids

    check()


def test_a_server_we_start_sends_no_analytics_unless_the_users_settings_ask(tmp_path, monkeypatch):
    """Keeper and per-command server both build their environment here; the suite itself runs with analytics
    off, so the choice is checked directly: no setting -> --analytics-off and DO_NOT_TRACK; a setting in the
    environment or in the active Prefect profile -> left as the user has it."""
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PREFECT_PROFILE", raising=False)
    base = {"PATH": "/usr/bin", "PREFECT_API_URL": "http://elsewhere/api"}
    env, flags = localserver._server_env(base)
    assert flags == ["--analytics-off"] and env["DO_NOT_TRACK"] == "1" and "PREFECT_API_URL" not in env
    env, flags = localserver._server_env({**base, "PREFECT_SERVER_ANALYTICS_ENABLED": "true"})
    assert flags == [] and "DO_NOT_TRACK" not in env
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "profiles.toml").write_text('active = "mine"\n[profiles.mine]\nPREFECT_SERVER_ANALYTICS_ENABLED = "true"\n')
    env, flags = localserver._server_env(base)
    assert flags == [] and "DO_NOT_TRACK" not in env


def test_with_two_servers_up_each_ones_ui_reads_its_own_api(prefect_harness, fresh_home, tmp_path):
    """Prefect's UI asks its server's /ui-settings where the API is. Two of our servers run at once (the session's and
    this module's), so at most one has port 4200: each must answer its own address, never 4200's (a user would see
    another server's runs, or "Page not found" for their own)."""
    import urllib.request

    env = env_for(fresh_home, tmp_path)
    started = subprocess.run([*CLI, "env", "--track", "--no_import_check"], env=env, capture_output=True, text=True, timeout=600)
    assert started.returncode == 0, started.stderr[-2000:]
    records = [prefect_harness, localserver.read_record(fresh_home)]
    assert records[1] is not None and records[0].port != records[1].port
    assert any(record.port != localserver.PREFERRED_PORT for record in records)
    for record in records:
        with urllib.request.urlopen(f"{record.ui_url}/ui-settings", timeout=60) as answer:
            settings = json.load(answer)
        assert settings["api_url"] == record.url == f"http://127.0.0.1:{record.port}/api", (settings, record)


def test_a_database_an_earlier_server_left_readable_is_made_owner_only(tmp_path):
    for name in ("prefect.db", "prefect.db-wal"):
        (tmp_path / name).write_text("")
        os.chmod(tmp_path / name, 0o644)
    localserver.private_database(tmp_path)
    assert {stat.S_IMODE((tmp_path / name).stat().st_mode) for name in ("prefect.db", "prefect.db-wal")} == {0o600}
