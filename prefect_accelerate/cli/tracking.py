"""The one choice every operational command offers: run through Prefect, or call the core directly.

Tracked, a command runs as a Prefect flow: it appears in the Prefect server at PREFECT_API_URL (or, when
that is unset, the long-lived local server of this PREFECT_HOME, started on first need: localserver.py),
with logs, artifacts and state. Untracked, it calls the same core function in this process, with no
Prefect import at all.

Defaults (README, "Tracked or not"): commands that run or change something on the machine (launch,
test, check, pipeline, validate, merge-weights, tpu-config) are tracked; commands that only read or
edit local files or print a report (config, env, estimate-memory, to-fsdp2, plan) run directly,
because even a running server adds a second or two of Prefect import and API calls. ``--track``/``--no-track``
override per call; PREFECT_ACCELERATE_TRACK=always|never|auto overrides the default.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator

from prefect_accelerate.errors import UsageError

TRACK_ENV = "PREFECT_ACCELERATE_TRACK"


def add_tracking_flags(parser: argparse.ArgumentParser, *, tracked_by_default: bool) -> None:
    """Add ``--track`` / ``--no-track`` to a subcommand; the default is recorded for `should_track`."""
    group = parser.add_argument_group("Tracking")
    default_text = "default" if tracked_by_default else "off by default"
    group.add_argument(
        "--track", dest="track", action="store_const", const=True, default=None,
        help=f"Run as a Prefect flow, recorded by the server at PREFECT_API_URL or, with none set, the long-lived local server of PREFECT_HOME ({default_text}).",
    )
    group.add_argument(
        "--no-track", "--no_track", dest="track", action="store_const", const=False,
        help="Call the operation directly, without Prefect.",
    )
    parser.set_defaults(tracked_by_default=tracked_by_default)


def tracking_wanted(args: argparse.Namespace) -> tuple[bool, bool]:
    """(whether this call should run through Prefect, whether that was asked for explicitly)."""
    if getattr(args, "track", None) is not None:
        return bool(args.track), bool(args.track)
    setting = os.environ.get(TRACK_ENV, "auto").strip().lower()
    if setting in ("always", "1", "true", "yes"):
        return True, True
    if setting in ("never", "0", "false", "no"):
        return False, False
    if setting != "auto":
        raise UsageError(
            f"The environment variable {TRACK_ENV} is set to {setting!r}, which is not a tracking mode. "
            "Use `always`, `never` or `auto` (each command's own default), or unset it."
        )
    return bool(getattr(args, "tracked_by_default", False)), False


def should_track(args: argparse.Namespace) -> bool:
    """Decide whether this invocation runs through Prefect, and if so make sure a server answers first.

    Tracking never stops the work: when no server answers in time the command runs untracked after one
    paragraph saying why, unless tracking was asked for explicitly (then: exit 2, nothing started).
    """
    wanted, explicit = tracking_wanted(args)
    if not wanted:
        return False
    from prefect_accelerate.localserver import ServerUnavailable

    try:
        connect()
    except ServerUnavailable as why:
        if explicit:
            raise UsageError(
                f"{unavailable_paragraph(str(why))} Tracking was asked for explicitly (--track or {TRACK_ENV}=always), "
                "so nothing was started."
            ) from None
        print(f"warning: {unavailable_paragraph(str(why))} Running untracked this time.", file=sys.stderr, flush=True)
        return False
    return True


def unavailable_paragraph(why: str) -> str:
    return (
        f"Tracking is not available: {why}. To track, point PREFECT_API_URL at a running Prefect server, or start "
        "the local one with `prefect-accelerate server start` (then `prefect-accelerate server status`); "
        "`--no-track` runs without Prefect and skips this check."
    )


def connect() -> str:
    """The Prefect API this process will report to: PREFECT_API_URL when set (checked), else the local server
    (found or started), else, with PREFECT_ACCELERATE_SERVER=ephemeral, a server for this command only.

    Raises:
        ServerUnavailable: nothing answered in time.
    """
    url = ServerSearch().result()
    _use(url)
    return url


class ServerSearch:
    """Finding (or starting) the Prefect server this command reports to, in a thread of its own, so that a
    launch can start its training meanwhile (cli/launch_cmd.py). Settings are read here, before anything
    starts, so a bad one is an error before the training; `result()` gives the API URL once it answers.
    The URL is not put into effect here (that is `_use`, in the thread that runs the flow)."""

    def __init__(self) -> None:
        from prefect_accelerate import localserver

        self._url = _configured_url()
        self._mode = localserver.server_mode()
        localserver.startup_timeout(), localserver.idle_seconds()  # a bad setting fails now, before anything starts
        self._done = threading.Event()
        self._answer: str | BaseException | None = None
        threading.Thread(target=self._search, name="prefect-server-search", daemon=True).start()

    def _search(self) -> None:
        try:
            self._answer = _locate(self._url, self._mode)
        except BaseException as error:  # noqa: BLE001 - handed to whoever asks for the result
            self._answer = error
        finally:
            self._done.set()

    @property
    def starts_local_server(self) -> bool:
        """Whether the server searched for is the long-lived local one (which outlives this command)."""
        return not self._url and self._mode == "local"

    def describe(self) -> str:
        if self._url:
            return f"the Prefect server at PREFECT_API_URL={self._url}"
        return "the local Prefect server" if self._mode == "local" else "this command's own Prefect server"

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the search is over (a server answers, or none will), after waiting up to `timeout` seconds."""
        return self._done.wait(timeout)

    def result(self) -> str:
        """The API URL of a server that answers; waits for the search to end.

        Raises:
            ServerUnavailable: nothing answered in time.
        """
        self._done.wait()
        if isinstance(self._answer, BaseException):
            raise self._answer
        assert self._answer is not None
        return self._answer


def _locate(url: str | None, mode: str) -> str:
    from prefect_accelerate import localserver

    if url:
        if not localserver.reachable(url):
            raise localserver.ServerUnavailable(f"the Prefect server at PREFECT_API_URL={url} does not answer")
        return url
    if mode == "ephemeral":
        from prefect_accelerate.localserver.ephemeral import start_ephemeral

        return start_ephemeral()
    record, started = localserver.ensure_server()
    if started:
        idle = record.idle_seconds / 60
        print(
            f"[prefect-accelerate] Started a local Prefect server for {localserver.prefect_home()} at {record.ui_url} "
            f"(UI and API; log: {localserver.files_dir(localserver.prefect_home()) / 'server.log'}). Later commands reuse it; "
            + (f"it stops after {idle:g} minutes unused, " if idle > 0 else "")
            + "`prefect-accelerate server stop` stops it now.",
            file=sys.stderr, flush=True,
        )
    return record.url


def _configured_url() -> str | None:
    if "prefect.settings" in sys.modules:  # already imported (in-process callers): its settings are what counts
        from prefect.settings import get_current_settings

        url = get_current_settings().api.url
        if url:
            return str(url)
    from prefect_accelerate.localserver import configured_api_url

    return configured_api_url()


_SETTINGS = contextlib.ExitStack()


def _use(url: str) -> None:
    """Point Prefect (and every child process) at `url` for the rest of this process."""
    os.environ["PREFECT_API_URL"] = url
    if "prefect.context" not in sys.modules:
        return  # Prefect reads the environment when it is first imported
    import prefect.context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value() == url:
        return

    _SETTINGS.enter_context(temporary_settings(updates={PREFECT_API_URL: url}))
    replace_global = getattr(prefect.context, "_temporary_global_settings_context", None)
    if replace_global is not None:  # threads Prefect starts later read the process-global context
        _SETTINGS.enter_context(replace_global(prefect.context.get_settings_context()))


#: seconds the last logs and events of a tracked launch get to reach the server once the training has ended
FLUSH_SECONDS = 5.0


@contextlib.contextmanager
def bounded_bookkeeping(flush_seconds: float = FLUSH_SECONDS) -> Iterator[None]:
    """Around a flow run whose end the user waits for: nothing after the training waits on Prefect's bookkeeping
    for longer than it must. The flow-run heartbeat thread is not joined (it sleeps in one-second steps and
    stops by itself at the next; Prefect's async engine does not join it either), and the run's last logs and
    events get at most `flush_seconds` to reach the server before the command goes on to exit."""
    import inspect

    import prefect.flow_engine as flow_engine

    original = getattr(flow_engine, "_send_heartbeats", None)
    patched = original is not None and "join_on_exit" in inspect.signature(original).parameters
    if patched:
        flow_engine._send_heartbeats = lambda engine, join_on_exit=False: original(engine, join_on_exit=False)  # type: ignore[assignment]
    try:
        yield
    finally:
        if patched:
            flow_engine._send_heartbeats = original  # type: ignore[assignment]
        _flush(flush_seconds)


def _flush(seconds: float) -> None:
    """Send what Prefect still queues (run logs, then events such as task-run states), for at most `seconds`."""
    import time

    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    deadline = time.monotonic() + seconds
    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=max(deadline - time.monotonic(), 0.0))


#: seconds between health checks of the server while a tracked launch runs
WATCH_SECONDS = 2.0


@contextlib.contextmanager
def surviving_server_loss(outcome: dict, *, quiet: bool = False) -> Iterator[None]:
    """While a tracked launch runs, check that its Prefect server still answers. If it goes away, say so once,
    keep the training running (its output still reaches the console and its run folder), and when the
    training ends, end this process with the training's exit code: Prefect's own calls to a server that
    is gone would retry for minutes and end in a traceback.

    `outcome` is filled by the launch task when the training ends ("result" or "interrupted").
    """
    url = os.environ.get("PREFECT_API_URL", "")
    done = threading.Event()

    def watch() -> None:
        from prefect_accelerate.localserver import probe

        failures, lost = 0, False
        while not done.wait(WATCH_SECONDS):
            if not lost:
                answer = probe(url)
                failures = 0 if answer == "ok" else failures + 1
                # nothing listening is certain at once; a slow answer may be a busy machine, so give it a minute
                lost = (answer == "refused" and failures >= 3) or failures >= 30
                if lost:
                    logging.raiseExceptions = False  # Prefect's log shipper would print an error per batch
                    print(
                        f"warning: the Prefect server at {url} stopped answering during the launch. The training goes on, "
                        "its output still goes to this console and to its run folder, and this command ends with its "
                        "exit code when it ends; the run's record in Prefect stops here.",
                        file=sys.stderr, flush=True,
                    )
            if lost and ("result" in outcome or "interrupted" in outcome):
                _exit_now(outcome, quiet)

    threading.Thread(target=watch, name="prefect-server-watch", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def _exit_now(outcome: dict, quiet: bool) -> None:
    code = int(outcome.get("interrupted") or 0)  # type: ignore[call-overload]
    result = outcome.get("result")
    if result is not None:
        from prefect_accelerate.errors import PrefectAccelerateError

        try:
            result.raise_for_failure(quiet=quiet)  # type: ignore[attr-defined]
            print(f"Training finished (exit code 0); its output is in {result.log_path}.", file=sys.stderr)  # type: ignore[attr-defined]
        except PrefectAccelerateError as error:
            print(f"error: {error.message}", file=sys.stderr)
            code = error.exit_code
    sys.stdout.flush()
    sys.stderr.flush()
    # the training processes are already gone (the supervisor ended them); what is left is Prefect's
    # bookkeeping against a server that no longer exists, which has nothing to finish
    os._exit(code)
