"""Test-session set-up shared by every test module.

The environment is fixed before anything imports Prefect or huggingface_hub: a private PREFECT_HOME
and HF_HOME under the session's temp folder, Hub access off, analytics off, and the torchvision shim
(tests/shims/sitecustomize.py) for this process and every child process.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHIMS = REPO / "tests" / "shims"

_SESSION_ROOT = Path(tempfile.mkdtemp(prefix="pa-tests-"))
_ENV = {
    "PREFECT_HOME": str(_SESSION_ROOT / "prefect-home"),
    "HF_HOME": str(_SESSION_ROOT / "hf-home"),
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_ACCELERATE_STATE_DIR": str(_SESSION_ROOT / "state"),
    "PREFECT_ACCELERATE_CACHE_DIR": str(_SESSION_ROOT / "cache"),  # shared by the session, never the user's
    "XDG_CONFIG_HOME": str(_SESSION_ROOT / "config"),  # mlflow (via sagemaker) writes telemetry state there
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PYTHONPATH": os.pathsep.join(p for p in (str(SHIMS), os.environ.get("PYTHONPATH", "")) if p),
}
os.environ.update(_ENV)
os.environ.pop("PREFECT_API_URL", None)
os.environ.pop("XDG_CACHE_HOME", None)
sys.path.insert(0, str(SHIMS))
sys.path.insert(0, str(REPO / "tests"))  # shared test helpers: `from helpers.x import ...`
import sitecustomize  # noqa: E402,F401  (the shim; a no-op when torchvision works)


@pytest.fixture(scope="session")
def session_root() -> Path:
    return _SESSION_ROOT


@pytest.fixture(scope="session", autouse=True)
def stop_local_prefect_server():
    """Tracked commands started as child processes with no PREFECT_API_URL find (or start) the long-lived local
    server of the session's PREFECT_HOME; it is stopped by its recorded pid when the session ends."""
    yield
    from prefect_accelerate.localserver import stop_server

    stop_server(Path(_ENV["PREFECT_HOME"]))


@pytest.fixture(scope="session")
def prefect_harness(stop_local_prefect_server):
    """The session's Prefect server: the same long-lived local server a user gets (one start-up, 10-40 s on a
    loaded 2-core machine), shared by in-process flows and by every tracked command the tests start."""
    import prefect.context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from prefect_accelerate.localserver import ensure_server

    record, _ = ensure_server(Path(_ENV["PREFECT_HOME"]), timeout=300)
    with temporary_settings(updates={PREFECT_API_URL: record.url}):
        # threads Prefect starts later (log and event shippers) read the process-global settings
        with prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()):
            yield record
            from prefect.events.worker import EventsWorker
            from prefect.logging.handlers import APILogWorker

            with contextlib.suppress(RuntimeError):
                APILogWorker.drain_all(timeout=30)
            EventsWorker.drain_all()


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """A private HF_HOME for one test, so the default config path is under tmp_path."""
    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    return home


@pytest.fixture(autouse=True)
def no_traffic_off_this_machine():
    """Every test runs under the network guard (tests/launchers/fakes/netguard.py): a connection or a name
    lookup for anything but loopback fails the call at once and, here, the test. Child processes are not
    covered; those that could reach a cloud (gcloud) run in a network namespace of their own."""
    sys.path.insert(0, str(REPO / "tests" / "launchers" / "fakes"))
    try:
        from netguard import BLOCKED, guarded
    finally:
        sys.path.remove(str(REPO / "tests" / "launchers" / "fakes"))
    before = len(BLOCKED)
    with guarded():
        yield
    attempted = BLOCKED[before:]
    assert not attempted, f"the test tried to reach beyond this machine: {attempted}"


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch is a dependency
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# `./dev test` (and so CI) sets this: a test skipped because an optional engine failed to import (an
# importorskip of deepspeed, accelerate, timm..., all installed by ./dev) would otherwise pass the suite
# silently. Skips for a missing system tool (gcloud, unprivileged `unshare`) or CUDA stay skips.
_STRICT = os.environ.get("PREFECT_ACCELERATE_TESTS_STRICT") == "1"
_UNEXPECTED_SKIPS: list[str] = []


def pytest_runtest_logreport(report):
    if _STRICT and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if "could not import" in reason:  # importorskip's wording; tool checks (gcloud, unshare) may skip
            _UNEXPECTED_SKIPS.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if _UNEXPECTED_SKIPS and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if _UNEXPECTED_SKIPS:
        terminalreporter.section("skipped tests count as failures here (PREFECT_ACCELERATE_TESTS_STRICT=1)")
        for line in _UNEXPECTED_SKIPS:
            terminalreporter.write_line(line)
