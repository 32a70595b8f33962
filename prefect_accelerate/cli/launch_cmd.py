"""`prefect-accelerate launch`: `accelerate launch`'s flags, run directly or as a Prefect flow.

`--dry-run` prints the plan and starts nothing; it imports neither torch nor Prefect.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from prefect_accelerate.cli.tracking import add_tracking_flags, should_track
from prefect_accelerate.errors import UsageError
from prefect_accelerate.launchers.flags import LAUNCH_FLAGS, LaunchFlag

DESCRIPTION = (
    "Launch a training script with the same flags, config file and environment as `accelerate launch`. "
    "Values come from the config file (--config_file, else the default config), then defaults; flags you "
    "pass win. Everything after the script's name goes to the script untouched."
)


def _add_flag(group: argparse._ArgumentGroup, flag: LaunchFlag) -> None:
    kwargs: dict = {"dest": flag.dest, "help": flag.help}
    if flag.kind in ("store", "append"):
        kwargs.update(default=flag.default, type=flag.type, choices=flag.choices)
        if flag.metavar:
            kwargs["metavar"] = flag.metavar
        if flag.kind == "append":
            kwargs["action"] = "append"
    elif flag.kind == "store_true":
        kwargs.update(action="store_true", default=flag.default)
    elif flag.kind == "store_false":
        kwargs.update(action="store_const", const=False, default=argparse.SUPPRESS)
    group.add_argument(*flag.options, **kwargs)


def add_launch_arguments(parser: argparse.ArgumentParser, *, with_script: bool = True) -> None:
    """Every `accelerate launch` flag (from the flag table), grouped as Accelerate groups them."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in LAUNCH_FLAGS:
        if flag.group == "options":
            _add_flag(parser._optionals, flag)  # type: ignore[arg-type]
            continue
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(flag.group)
        _add_flag(groups[flag.group], flag)
    ours = parser.add_argument_group("prefect-accelerate")
    ours.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true", help="Print the launch plan and exit; start nothing.")
    ours.add_argument("--json", dest="json", action="store_true", help="With --dry-run: print the plan as one JSON object.")
    ours.add_argument("--timeout", dest="timeout", type=float, default=None, help="Stop the launch (and every process it started) after this many seconds.")
    ours.add_argument("--grace_period", dest="grace_period", type=float, default=20.0, help="Seconds between SIGTERM and SIGKILL when stopping (default 20, below Prefect's 30).")
    ours.add_argument("--run_dir", dest="run_dir", default=None, help="Folder for this launch's logs and state (default: a new folder under the state directory).")
    if with_script:
        parser.add_argument("training_script", help="The script (or module with -m, or executable with --no_python) to launch.")
        parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="Arguments for the script.")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("launch", help="Launch a training script, as `accelerate launch` does.", description=DESCRIPTION)
    add_launch_arguments(parser)
    add_tracking_flags(parser, tracked_by_default=True)
    parser.set_defaults(func=run)


def plan_from_args(args: argparse.Namespace):
    from prefect_accelerate.launchers import check_training_script, plan_launch
    from prefect_accelerate.launchers.options import options_from_namespace

    options = options_from_namespace(args)
    check_training_script(options)
    if options.run_dir and os.path.exists(options.run_dir) and not os.path.isdir(options.run_dir):
        raise UsageError(f"--run_dir {options.run_dir} is a file, not a folder. Pass a folder for the launch's logs (it is created if missing).")
    return options, plan_launch(options)


def print_plan(plan, as_json: bool) -> None:
    if as_json:
        print(json.dumps(plan.to_json_dict(), indent=2))
    else:
        print(plan.describe())


def run(args: argparse.Namespace) -> int:
    options, plan = plan_from_args(args)
    if args.dry_run:
        print_plan(plan, args.json)
        return 0
    from prefect_accelerate.launchers.engines import require_client

    require_client(plan)
    # a run folder that cannot be made is one line of error, not a screen of defaults warnings and then the error
    made = _make_run_dir_first(plan.run_dir)
    try:
        return _run_planned(args, options, plan)
    finally:
        if made is not None:
            with contextlib.suppress(OSError):
                made.rmdir()  # only if the command ended before anything was written there


def _make_run_dir_first(run_dir: str | None):
    """Create the launch's named run folder now (a UsageError if it cannot be); the folder, when this call made it."""
    if not run_dir or os.path.isdir(run_dir):
        return None
    from pathlib import Path

    from prefect_accelerate.launchers.state import make_private_dir

    return make_private_dir(Path(run_dir), "run folder")


def _run_planned(args: argparse.Namespace, options, plan) -> int:
    for note in plan.notes:
        print(f"[prefect-accelerate] {note}", file=sys.stderr)
    for warning in plan.warnings:
        print(warning, file=sys.stderr)
    quiet = bool(getattr(options, "quiet", False))
    if should_track(args):
        result = _tracked(args, options, plan, quiet)
    else:
        result = _untracked(options, plan)
    result.raise_for_failure(quiet=quiet)
    return 0


def _untracked(options, plan):
    from prefect_accelerate.launchers.execute import execute

    return execute(plan, on_line=_raw_echo, timeout=options.timeout, grace=options.grace_period)


def _tracked(args: argparse.Namespace, options, plan, quiet: bool):
    """The launch as a flow run; the training's outcome never depends on the Prefect server (tracking.py)."""
    from prefect_accelerate.cli.tracking import surviving_server_loss, tracking_wanted, unavailable_paragraph
    from prefect_accelerate.errors import PrefectAccelerateError, UsageError
    from prefect_accelerate.flows.launch import launch_flow
    from prefect_accelerate.tasks.launch import LAST_OUTCOME

    try:
        with surviving_server_loss(LAST_OUTCOME, quiet=quiet):
            return launch_flow(options=options, plan=plan)
    except PrefectAccelerateError:
        raise
    except Exception as error:  # Prefect's bookkeeping failed (its server went away), not the training
        result = LAST_OUTCOME.get("result")
        if result is not None:
            print(f"warning: the training ended, but Prefect could not record it ({type(error).__name__}: {error}).", file=sys.stderr)
            return result
        if LAST_OUTCOME.get("started"):
            raise
        why = unavailable_paragraph(f"Prefect could not record the run ({type(error).__name__}: {error})")
        if tracking_wanted(args)[1]:
            raise UsageError(f"{why} Tracking was asked for explicitly, so the training was not started.") from None
        print(f"warning: {why} Running untracked this time.", file=sys.stderr, flush=True)
        return _untracked(options, plan)


def _raw_echo(label: str, line: str) -> None:
    print(f"[{label}] {line}" if label.startswith(("rank ", "node ")) else line, flush=True)
