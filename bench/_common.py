"""Shared helpers for the benchmarks: timing commands, medians, a local Prefect server, a table printer."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
SHIMS = REPO / "tests" / "shims"


def bench_env(**extra: str) -> dict[str, str]:
    """The environment every measured command gets: quiet Prefect, offline Hub, the torchvision shim."""
    env = dict(os.environ)
    env.update({
        "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "PYTHONPATH": os.pathsep.join(p for p in (str(SHIMS), env.get("PYTHONPATH", "")) if p),
    })
    env.pop("PREFECT_API_URL", None)
    env.update(extra)
    return env


def time_command(argv: list[str], env: dict[str, str], repeat: int, cwd: str | None = None, check: bool = True) -> list[float]:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        done = subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        times.append(time.perf_counter() - began)
        if check and done.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def print_table(title: str, rows: list[tuple[str, float, float | None]], baseline_name: str) -> None:
    """rows: (name, median seconds, ratio to the baseline)."""
    print(f"\n{title}")
    width = max(len(r[0]) for r in rows)
    print(f"{'command'.ljust(width)}  median s  ratio to {baseline_name}")
    for name, seconds, ratio in rows:
        print(f"{name.ljust(width)}  {seconds:8.2f}  {'' if ratio is None else f'{ratio:.2f}x'}")
    print(f"(load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def local_prefect_server():
    """A `prefect server` on 127.0.0.1 with its own PREFECT_HOME; yields its API URL."""
    home = tempfile.mkdtemp(prefix="bench-prefect-")
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    prefect = [str(VENV_BIN / "prefect")] if (VENV_BIN / "prefect").exists() else [sys.executable, "-m", "prefect"]
    process = subprocess.Popen([*prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                               env=bench_env(PREFECT_HOME=home), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        else:
            raise SystemExit("prefect server did not start")
        yield url, home
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
