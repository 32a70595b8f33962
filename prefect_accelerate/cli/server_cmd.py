"""`prefect-accelerate server status|start|stop`: the long-lived local Prefect server of this PREFECT_HOME.

Tracked commands start it on first need; these subcommands show, start or stop it by hand. A server at
PREFECT_API_URL is never touched: it is someone else's.
"""

from __future__ import annotations

import argparse
import sys
import time


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "server", help="Show, start or stop the local Prefect server that tracked commands use.",
        description="Tracked commands report to the Prefect server at PREFECT_API_URL; with none set, to one long-lived "
        "local Prefect server per PREFECT_HOME, started on first need and stopped after a period unused "
        "(PREFECT_ACCELERATE_SERVER_IDLE_MINUTES, default 60; 0 = never).",
    )
    actions = parser.add_subparsers(title="actions", metavar="<action>")
    for name, func, text in (
        ("status", status, "Say whether the local server runs, where, and since when (exit 1 when it does not)."),
        ("start", start, "Start the local server now (or find the running one) and say where it is."),
        ("stop", stop, "Stop the local server (tracked commands start a new one when they need it)."),
    ):
        actions.add_parser(name, help=text, description=text).set_defaults(func=func)
    parser.set_defaults(func=lambda args: (parser.print_help(), 1)[1])


def _home_line() -> str:
    from prefect_accelerate.localserver import prefect_home

    return f"PREFECT_HOME={prefect_home()}"


def _external_note() -> None:
    from prefect_accelerate.localserver import configured_api_url

    url = configured_api_url()
    if url:
        print(f"Note: PREFECT_API_URL is set ({url}); tracked commands report there, not to the local server.")


def status(args: argparse.Namespace) -> int:  # noqa: ARG001
    from prefect_accelerate import localserver

    _external_note()
    home = localserver.prefect_home()
    record = localserver.read_record(home)
    if record is None:
        print(f"No local Prefect server for {_home_line()}; the next tracked command starts one.")
        return 1
    if not localserver.is_running(record):
        print(f"The local Prefect server recorded for {_home_line()} ({record.url}) is gone; the next tracked command replaces it.")
        return 1
    if record.state != "ready":
        print(f"The local Prefect server for {_home_line()} is starting at {record.ui_url} (keeper pid {record.keeper_pid}).")
        return 1
    answers = localserver.healthy(record.url)
    idle = f"stops after {record.idle_seconds / 60:g} minutes unused" if record.idle_seconds > 0 else "never stops by itself"
    print(
        f"Local Prefect server for {_home_line()}: {record.ui_url} (API {record.url}), pid {record.pid}, keeper pid "
        f"{record.keeper_pid}, up {_duration(time.time() - record.started_at)}, {idle}; "
        + ("answering." if answers else "NOT answering its health check.")
    )
    return 0 if answers else 1


def start(args: argparse.Namespace) -> int:  # noqa: ARG001
    from prefect_accelerate import localserver

    _external_note()
    home = localserver.prefect_home()
    try:
        record, started = localserver.ensure_server(home)
    except localserver.ServerUnavailable as why:
        print(f"error: {why}. Its log is {localserver.files_dir(home) / 'server.log'}.", file=sys.stderr)
        return 1
    verb = "Started" if started else "Already running:"
    print(f"{verb} the local Prefect server for {_home_line()} at {record.ui_url} (pid {record.pid}); stop it with "
          "`prefect-accelerate server stop`.")
    return 0


def stop(args: argparse.Namespace) -> int:  # noqa: ARG001
    from prefect_accelerate import localserver

    record = localserver.stop_server()
    if record is None:
        print(f"No local Prefect server is running for {_home_line()}.")
    else:
        print(f"Stopped the local Prefect server for {_home_line()} ({record.ui_url}, pid {record.pid}).")
    return 0


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
