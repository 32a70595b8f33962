"""One long-lived local Prefect server per PREFECT_HOME: found, health-checked and reused by every command.

With no PREFECT_API_URL, the first tracked command starts Prefect's own server (`prefect server start`
on 127.0.0.1) under a small keeper process in a session of its own, so Ctrl-C in the terminal reaches
neither. Later commands, concurrent ones included, read the record and reuse the server.

Files under `$PREFECT_HOME/prefect-accelerate/`:
- `server.json`   the record (address, pids with their start times, state), written atomically by the keeper
- `server.lock`   held exclusively by whoever starts (or stops) a server, so only one is ever started
- `server.inuse`  held shared by every command that uses the server, for as long as it runs; the keeper
                  stops the server when nobody has held it (and no client was connected) for the idle period
- `server.log`    the keeper's and the server's output

The keeper (keeper.py) imports nothing heavy (stdlib and psutil): it starts the server, waits until it
answers, then polls every few seconds. The per-command server of PREFECT_ACCELERATE_SERVER=ephemeral is
ephemeral.py. This package never imports Prefect.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

#: local (the default: one long-lived server per PREFECT_HOME) | ephemeral (one per command, as Prefect does)
MODE_ENV = "PREFECT_ACCELERATE_SERVER"
#: minutes without use after which the keeper stops the server; 0 = never
IDLE_ENV = "PREFECT_ACCELERATE_SERVER_IDLE_MINUTES"
IDLE_MINUTES_DEFAULT = 60.0
#: seconds a command waits for a server to answer before it runs untracked (or exits 2 with --track)
TIMEOUT_ENV = "PREFECT_ACCELERATE_SERVER_TIMEOUT"
TIMEOUT_DEFAULT = 120.0
#: Prefect's own default port, used when free; otherwise any free loopback port
PREFERRED_PORT = 4200
#: SIGTERM to SIGKILL when stopping the server (a busy SQLite server takes a few seconds to shut down)
STOP_GRACE_SECONDS = 20.0
#: a keeper that could not get its server healthy in this long gives up (a command stopped waiting earlier)
KEEPER_START_LIMIT_SECONDS = 600.0

MODES = ("local", "ephemeral")


class ServerUnavailable(Exception):
    """No server answered in time; the message says why (one or two sentences, no fix)."""


def server_mode() -> str:
    mode = os.environ.get(MODE_ENV, "local").strip().lower() or "local"
    if mode not in MODES:
        from prefect_accelerate.errors import UsageError

        raise UsageError(
            f"The environment variable {MODE_ENV} is set to {mode!r}, which is not a server mode. Use `local` "
            "(one long-lived Prefect server per PREFECT_HOME, the default) or `ephemeral` (a server per command), or unset it."
        )
    return mode


def _float_env(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        from prefect_accelerate.errors import UsageError

        raise UsageError(f"The environment variable {name} is set to {raw!r}, which is not a number. Set a number or unset it.") from None
    return max(value, 0.0)


def idle_seconds() -> float:
    return _float_env(IDLE_ENV, IDLE_MINUTES_DEFAULT) * 60.0


def startup_timeout() -> float:
    return _float_env(TIMEOUT_ENV, TIMEOUT_DEFAULT)


def prefect_home() -> Path:
    """PREFECT_HOME as Prefect resolves it by default (the environment, else ~/.prefect)."""
    return Path(os.path.expanduser(os.environ.get("PREFECT_HOME") or "~/.prefect"))


def files_dir(home: Path) -> Path:
    return home / "prefect-accelerate"


# -- what the user's Prefect settings say (read without importing Prefect) -----------------------------

def _profile_sets(name: str) -> bool:
    """Whether the active Prefect profile sets `name` (`prefect config set NAME=...`)."""
    from prefect_accelerate.envreport.prefectapi import _dig, _read_toml, profiles_path

    data = _read_toml(profiles_path(os.environ, Path.cwd(), {}))
    active = os.environ.get("PREFECT_PROFILE") or data.get("active")
    profile = _dig(data, "profiles", str(active)) if active else None
    return isinstance(profile, dict) and name in profile


def configured_api_url() -> str | None:
    """PREFECT_API_URL from wherever Prefect would read it (environment, .env, prefect.toml, profile)."""
    from prefect_accelerate.envreport.prefectapi import prefect_api

    return prefect_api().url


def _server_env(base: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """The environment and extra flags for a server we start: no analytics unless the user's settings ask."""
    env = {k: v for k, v in base.items() if k != "PREFECT_API_URL"}
    asked = "PREFECT_SERVER_ANALYTICS_ENABLED" in env or _profile_sets("PREFECT_SERVER_ANALYTICS_ENABLED")
    if asked:
        return env, []
    env.setdefault("DO_NOT_TRACK", "1")
    return env, ["--analytics-off"]


# -- the record ----------------------------------------------------------------------------------------

@dataclass
class ServerRecord:
    url: str
    port: int
    keeper_pid: int
    state: str = "starting"  # starting | ready | failed
    pid: int | None = None
    create_time: float | None = None
    started_at: float = 0.0
    idle_seconds: float = 0.0
    reason: str = ""

    @property
    def ui_url(self) -> str:
        return self.url.removesuffix("/api")


def record_path(home: Path) -> Path:
    return files_dir(home) / "server.json"


def read_record(home: Path) -> ServerRecord | None:
    try:
        data = json.loads(record_path(home).read_text())
        record = ServerRecord(**data)
    except (OSError, ValueError, TypeError):
        return None
    ints = (record.port, record.keeper_pid) + (() if record.pid is None else (record.pid,))
    if not (isinstance(record.url, str) and all(type(v) is int and v > 0 for v in ints)
            and isinstance(record.create_time, (int, float, type(None))) and isinstance(record.state, str)
            and isinstance(record.started_at, (int, float)) and isinstance(record.idle_seconds, (int, float))):
        return None  # not a record we wrote: treated as none (a stale one is replaced)
    return record


def _write_record(home: Path, record: ServerRecord) -> None:
    path = record_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(asdict(record)))
    os.replace(tmp, path)


def _remove_record(home: Path, keeper_pid: int | None = None) -> None:
    """Remove the record (only if it is still `keeper_pid`'s, when given)."""
    if keeper_pid is not None:
        current = read_record(home)
        if current is None or current.keeper_pid != keeper_pid:
            return
    with contextlib.suppress(FileNotFoundError):
        record_path(home).unlink()


def _process(pid: int | None, create_time: float | None = None):
    """The live process `pid` (started at `create_time` when given), else None: a recycled pid is not ours."""
    import psutil

    if not pid:
        return None
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        # psutil adds the boot time to the start tick count, and two processes can read a boot time one second
        # apart (the kernel rounds it): a margin of 2 s still tells a recycled pid from ours, which ran far longer
        if create_time is not None and abs(proc.create_time() - create_time) > 2.0:
            return None
        return proc
    except psutil.Error:
        return None


def is_running(record: ServerRecord) -> bool:
    if record.state == "ready":
        return _process(record.pid, record.create_time) is not None
    return _process(record.keeper_pid) is not None


def healthy(url: str, timeout: float = 5.0) -> bool:
    """Whether a Prefect API answers at `url` (its /health endpoint says 200)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout) as response:
            return response.status == 200
    except (OSError, ValueError):
        return False


def listens(pid: int, port: int) -> bool:
    """Whether process `pid` or one of its descendants listens on TCP `port` (the kernel's socket table, through
    psutil)."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return False
    for process in processes:
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in process.net_connections(kind="tcp")):
                return True
        except psutil.Error:
            continue
    return False


def probe(url: str, timeout: float = 5.0) -> str:
    """"ok" (the API answers), "refused" (nothing listens there) or "error" (no answer in time, or an error)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout):
            return "ok"
    except urllib.error.HTTPError:
        return "ok"
    except urllib.error.URLError as error:
        return "refused" if isinstance(error.reason, ConnectionRefusedError) else "error"
    except (OSError, ValueError):
        return "error"


def reachable(url: str, timeout: float = 10.0) -> bool:
    """Whether anything answers HTTP at `url` (any status: a server that wants a key still exists)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


# -- locks ---------------------------------------------------------------------------------------------

def _lock(path: Path, kind: int, deadline: float) -> int | None:
    """An open fd holding flock `kind` on `path`, or None when the deadline passed first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.1)


_IN_USE: dict[Path, int] = {}


def hold_in_use(home: Path, deadline: float) -> bool:
    """Mark the server of `home` as used by this process until it exits (the keeper will not stop it)."""
    if home in _IN_USE:
        return True
    path = files_dir(home) / "server.inuse"
    fd = _lock(path, fcntl.LOCK_SH, deadline)
    if fd is None:
        return False
    os.set_inheritable(fd, False)
    with contextlib.suppress(OSError):
        os.utime(path)
    _IN_USE[home] = fd
    return True


# -- starting, finding, stopping -----------------------------------------------------------------------

def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _free_port() -> int:
    # the server binds it seconds later, in its own process: from below the ephemeral range (launchers/ports.py)
    from prefect_accelerate.launchers.ports import rendezvous_port

    return rendezvous_port("127.0.0.1")


def _log_tail(home: Path, lines: int = 8) -> str:
    try:
        text = (files_dir(home) / "server.log").read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:] if line.strip())


def ensure_server(home: Path | None = None, timeout: float | None = None) -> tuple[ServerRecord, bool]:
    """The healthy local server of `home`, started first when there is none; (record, started_here).

    Raises:
        ServerUnavailable: no server answered within `timeout` seconds.
    """
    home = home or prefect_home()
    timeout = startup_timeout() if timeout is None else timeout
    deadline = time.monotonic() + timeout
    if not hold_in_use(home, deadline):
        raise ServerUnavailable(f"the local server under {home} was being stopped and that did not finish within {timeout:.0f} s")
    fd = _lock(files_dir(home) / "server.lock", fcntl.LOCK_EX, deadline)
    if fd is None:
        raise ServerUnavailable(f"another command has been starting the local server under {home} for more than {timeout:.0f} s")
    try:
        record = read_record(home)
        if record is not None and record.state != "failed" and is_running(record):
            return _wait_ready(home, record.keeper_pid, deadline, timeout), False
        _remove_record(home)  # stale: its processes are gone
        keeper = _spawn_keeper(home)
        return _wait_ready(home, keeper, deadline, timeout), True
    finally:
        os.close(fd)


#: the server's database holds run parameters and logs: the server we start writes it owner-only
#: (umask for the keeper and the server it starts; an existing database is made owner-only too)
SERVER_UMASK = 0o077
DATABASE_FILES = ("prefect.db", "prefect.db-wal", "prefect.db-shm", "prefect.db-journal")


def private_database(home: Path) -> None:
    """Make a database an earlier server left readable by others owner-only."""
    for name in DATABASE_FILES:
        with contextlib.suppress(OSError):
            os.chmod(home / name, 0o600)


def _spawn_keeper(home: Path) -> int:
    folder = files_dir(home)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    private_database(home)
    port = PREFERRED_PORT if _port_free(PREFERRED_PORT) else _free_port()
    with open(os.open(folder / "server.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
        keeper = subprocess.Popen(
            [sys.executable, "-m", "prefect_accelerate.localserver.keeper", str(home), str(port), str(idle_seconds())],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
            umask=SERVER_UMASK,
        )
    return keeper.pid


def _wait_ready(home: Path, keeper_pid: int, deadline: float, timeout: float) -> ServerRecord:
    while True:
        record = read_record(home)
        if record is not None and record.keeper_pid == keeper_pid:
            if record.state == "ready" and healthy(record.url, timeout=5.0):
                return record
            if record.state == "failed":
                _remove_record(home, keeper_pid)
                raise ServerUnavailable(f"the local Prefect server under {home} could not start: {record.reason}")
        if _process(keeper_pid) is None and (record is None or record.state != "ready"):
            raise ServerUnavailable(f"the local Prefect server under {home} exited while starting ({_log_tail(home) or 'no output'})")
        if time.monotonic() >= deadline:
            raise ServerUnavailable(
                f"the local Prefect server under {home} did not answer within {timeout:.0f} s (it may still be starting; "
                f"its log is {files_dir(home) / 'server.log'})"
            )
        time.sleep(0.25)


def stop_server(home: Path | None = None, grace: float = STOP_GRACE_SECONDS) -> ServerRecord | None:
    """Stop the local server of `home` (keeper and server) and remove its record; returns what was stopped."""
    home = home or prefect_home()
    record = read_record(home)
    if record is None:
        return None
    fd = _lock(files_dir(home) / "server.lock", fcntl.LOCK_EX, time.monotonic() + grace + 30)
    try:
        keeper = _process(record.keeper_pid)
        server = _process(record.pid, record.create_time) if record.pid else None
        if keeper is not None:
            with contextlib.suppress(OSError):
                keeper.terminate()  # the keeper stops its server, then removes the record
        _await_gone([p for p in (keeper, server) if p is not None], grace + 5)
        for proc in (server, keeper):
            if proc is not None and proc.is_running():
                with contextlib.suppress(OSError):
                    proc.kill()
        _remove_record(home)
    finally:
        if fd is not None:
            os.close(fd)
    return record


def _await_gone(procs: list, timeout: float) -> None:
    import psutil

    psutil.wait_procs(procs, timeout=timeout)


__all__ = [
    "IDLE_ENV", "MODE_ENV", "TIMEOUT_ENV", "ServerRecord", "ServerUnavailable", "configured_api_url", "ensure_server",
    "files_dir", "healthy", "is_running", "prefect_home", "probe", "reachable", "read_record", "record_path",
    "server_mode", "stop_server",
]
