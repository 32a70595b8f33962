"""The one choice every operational command offers: run through Prefect, or call the core directly.

Tracked, a command runs as a Prefect flow: it appears in the Prefect server at PREFECT_API_URL (or the
embedded local default when that is unset), with logs, artifacts and state. Untracked, it calls the
same core function in this process, with no Prefect import at all.

Defaults (README, "Tracked or not"): commands that run or change something on the machine (launch,
test, check, pipeline, validate, merge-weights, tpu-config) are tracked; commands that only read or
edit local files or print a report (config, env, estimate-memory, to-fsdp2, plan) run directly,
because the embedded server costs ~10 s per process on a small machine. ``--track``/``--no-track``
override per call; PREFECT_ACCELERATE_TRACK=always|never|auto overrides the default.
"""

from __future__ import annotations

import argparse
import os

from prefect_accelerate.errors import UsageError

TRACK_ENV = "PREFECT_ACCELERATE_TRACK"


def add_tracking_flags(parser: argparse.ArgumentParser, *, tracked_by_default: bool) -> None:
    """Add ``--track`` / ``--no-track`` to a subcommand; the default is recorded for `should_track`."""
    group = parser.add_argument_group("Tracking")
    default_text = "default" if tracked_by_default else "off by default"
    group.add_argument(
        "--track", dest="track", action="store_const", const=True, default=None,
        help=f"Run as a Prefect flow, recorded by the server at PREFECT_API_URL or the embedded local one ({default_text}).",
    )
    group.add_argument(
        "--no-track", "--no_track", dest="track", action="store_const", const=False,
        help="Call the operation directly, without Prefect.",
    )
    parser.set_defaults(tracked_by_default=tracked_by_default)


def should_track(args: argparse.Namespace) -> bool:
    """Decide whether this invocation runs through Prefect: flag, then environment, then default."""
    if getattr(args, "track", None) is not None:
        return bool(args.track)
    setting = os.environ.get(TRACK_ENV, "auto").strip().lower()
    if setting in ("always", "1", "true", "yes"):
        return True
    if setting in ("never", "0", "false", "no"):
        return False
    if setting != "auto":
        raise UsageError(
            f"The environment variable {TRACK_ENV} is set to {setting!r}, which is not a tracking mode. "
            "Use `always`, `never` or `auto` (each command's own default), or unset it."
        )
    return bool(getattr(args, "tracked_by_default", False))
