"""`prefect-accelerate launch`: `accelerate launch`'s flags, run directly or as a Prefect flow.

`--dry-run` prints the plan and starts nothing; it imports neither torch nor Prefect.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from prefect_accelerate.cli.tracking import TRACK_ENV, add_tracking_flags, should_track, tracking_wanted
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
    wanted, explicit = tracking_wanted(args)
    if wanted and _starts_here(plan):
        result = _training_first(options, plan, explicit, quiet)
    elif wanted and should_track(args):
        result = _tracked(args, options, plan, quiet)
    else:
        result = _untracked(options, plan)
    result.raise_for_failure(quiet=quiet)
    return 0


def _untracked(options, plan, started=None):
    """The launch without Prefect; `started`: it is already running (its lines already go to the console)."""
    from prefect_accelerate.launchers.execute import execute

    return execute(plan, on_line=_raw_echo, timeout=options.timeout, grace=options.grace_period, started=started)


def _starts_here(plan) -> bool:
    """Whether the plan runs as local processes (a remote engine submits a job, which its flow run records)."""
    from prefect_accelerate.launchers.engines import ENGINES

    engine = ENGINES.get(plan.launcher)
    return engine is None or not engine.remote


def _training_first(options, plan, explicit: bool, quiet: bool):
    """A tracked launch that never waits for Prefect: the training starts at once, its lines reach the console as
    they come, and the server is found (or started), Prefect imported and the flow run created meanwhile; the
    launch task then adopts the running processes, and the lines printed so far go to the run's logs in order.
    With tracking asked for explicitly, the server must answer before anything starts (exit 2 otherwise)."""
    from prefect_accelerate.cli.tracking import ServerSearch, unavailable_paragraph
    from prefect_accelerate.launchers.linebuffer import LineBuffer
    from prefect_accelerate.launchers.process import start_plan
    from prefect_accelerate.localserver import ServerUnavailable
    from prefect_accelerate.signals import raise_if_stopped

    search = ServerSearch()
    if explicit:
        try:
            search.result()
        except ServerUnavailable as why:
            raise UsageError(
                f"{unavailable_paragraph(str(why))} Tracking was asked for explicitly (--track or {TRACK_ENV}=always), "
                "so nothing was started."
            ) from None
    lines = LineBuffer()
    handle = start_plan(plan, on_line=lambda label, line: (lines(label, line), _raw_echo(label, line)))  # stamped, then shown
    try:
        # a running server answers within milliseconds; one still starting is waited for first, so that no CPU
        # goes into importing Prefect for a run that may never be recorded (the training wants that CPU)
        url = _server_while_training(search, handle, options.timeout)
        if url is None:
            lines.discard()
            return _untracked(options, plan, started=handle)
        from prefect_accelerate.flows.launch import launch_flow  # noqa: F401 - Prefect's import, while the training runs

        raise_if_stopped()  # a Ctrl-C that the import swallowed
        return _adopted_by_flow(url, options, plan, handle, lines, quiet)
    finally:
        handle.stop(options.grace_period)  # an interrupt came before anybody waited: nothing outlives us


def _server_while_training(search, handle, timeout: float | None) -> str | None:
    """The server's URL once it answers; None (said why) when none will, or the training ended (or passed its
    deadline) first: then the training goes on untracked, as it started."""
    import time

    from prefect_accelerate.cli.tracking import unavailable_paragraph
    from prefect_accelerate.localserver import ServerUnavailable

    while not search.wait(0.1):
        late = bool(timeout) and time.monotonic() >= handle.started + timeout  # type: ignore[operator]
        if not handle.running() or late:
            what = "the launch reached its deadline" if late and handle.running() else "the training ended"
            print(f"warning: {what} before {search.describe()} answered, so this launch is not recorded in "
                  f"Prefect; its output is in {handle.log_path}." + (" The server goes on starting; later commands use it."
                                                                      if search.starts_local_server else ""),
                  file=sys.stderr, flush=True)
            return None
    try:
        return search.result()
    except ServerUnavailable as why:
        print(f"warning: {unavailable_paragraph(str(why))} Running untracked this time.", file=sys.stderr, flush=True)
        return None


def _adopted_by_flow(url: str, options, plan, handle, lines, quiet: bool):
    """The launch flow run, whose launch task takes the running training over (tasks/launch.py `taking_over`)."""
    from prefect_accelerate.cli.tracking import bounded_bookkeeping, surviving_server_loss, _use
    from prefect_accelerate.errors import PrefectAccelerateError
    from prefect_accelerate.flows.launch import launch_flow
    from prefect_accelerate.tasks.launch import LAST_OUTCOME, taking_over

    _use(url)
    LAST_OUTCOME.clear()
    try:
        with surviving_server_loss(LAST_OUTCOME, quiet=quiet), taking_over(handle, lines), bounded_bookkeeping():
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
        lines.discard()
        print(f"warning: Prefect could not record this launch ({type(error).__name__}: {error}); the training goes on "
              "untracked.", file=sys.stderr, flush=True)
        return _untracked(options, plan, started=handle)


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
