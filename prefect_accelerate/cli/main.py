"""`prefect-accelerate`: Accelerate's subcommands, run directly or as Prefect flows.

Each subcommand lives in its own module with ``add_parser(subparsers)``; the module sets ``func`` on
its parser. Nothing here imports torch or prefect, so `--help` stays fast (bench/cli_startup.py).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import os
import sys
from collections.abc import Sequence

from prefect_accelerate._version import __version__
from prefect_accelerate.cli.parser import Parser
from prefect_accelerate.errors import PrefectAccelerateError, Terminated

# Subcommand modules, in Accelerate's order first, then our own. Only implemented commands appear.
COMMAND_MODULES: tuple[str, ...] = (
    "prefect_accelerate.cli.config_cmd",
    "prefect_accelerate.cli.estimate_cmd",
    "prefect_accelerate.cli.env_cmd",
    "prefect_accelerate.cli.launch_cmd",
    "prefect_accelerate.cli.merge_cmd",
    "prefect_accelerate.cli.tpu_config_cmd",
    "prefect_accelerate.cli.test_cmd",
    "prefect_accelerate.cli.pipeline_cmd",
    "prefect_accelerate.cli.validate_cmd",
    "prefect_accelerate.cli.fsdp2_cmd",
    "prefect_accelerate.cli.check_cmd",
    "prefect_accelerate.cli.server_cmd",
)

DEBUG_ENV = "PREFECT_ACCELERATE_DEBUG"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="prefect-accelerate",
        usage="prefect-accelerate <command> [<args>]",
        description=(
            "Accelerate's command-line workflow as Prefect tasks and flows. The subcommands take the same "
            "flags as `accelerate`; `--track`/`--no-track` choose between a Prefect flow run and a direct call."
        ),
    )
    parser.add_argument("--version", action="version", version=f"prefect-accelerate {__version__}")
    parser.add_argument(
        "--debug", dest="show_traceback", action="store_true",
        help=f"Show Python tracebacks for errors (also: {DEBUG_ENV}=1).",
    )
    # prog given: argparse would otherwise build it from the custom usage above ("prefect-accelerate <command> [<args>] validate")
    subparsers = parser.add_subparsers(title="commands", metavar="<command>", parser_class=Parser, prog="prefect-accelerate")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


#: what a shell reports for a process that SIGPIPE ended (128 + 13)
BROKEN_PIPE_EXIT_CODE = 141


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 1
    show_traceback = args.show_traceback or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    from prefect_accelerate.signals import interrupts_recorded, raise_if_stopped, sigterm_as_exception

    try:
        # SIGTERM unwinds like Ctrl-C, so every exit path runs its cleanup (a per-command Prefect server
        # included); Prefect's flow engine, which takes SIGTERM over during a flow, hands it back to this one
        with interrupts_recorded(), sigterm_as_exception():
            code = func(args)
        raise_if_stopped()  # an interrupt swallowed by code we do not own is still a stop
    except PrefectAccelerateError as error:
        if show_traceback:
            raise
        print(f"error: {error.message}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print("Interrupted; every process the command started was stopped.", file=sys.stderr)
        return 130
    except Terminated as signal_exit:
        print(f"Stopped by signal {signal_exit.signum}; every process the command started was stopped.", file=sys.stderr)
        return 128 + signal_exit.signum
    except BrokenPipeError:
        # the reader of our output went away (`... --dry-run | head`): stop quietly, as a process killed by SIGPIPE
        # would, and point stdout at /dev/null so the interpreter's last flush does not print a second complaint
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE_EXIT_CODE
    return int(code or 0)


def entrypoint() -> None:
    atexit.register(_skip_teardown)  # registered first, so it runs after every other exit handler
    code = main()
    if "prefect" in sys.modules:
        _EXIT_CODE.append(code)
    sys.exit(code)


#: the exit code of a command that imported Prefect, for `_skip_teardown`
_EXIT_CODE: list[int] = []


def _skip_teardown() -> None:
    """After the last exit handler (Prefect's log and event drains included, which run before any of these), end
    the process with its exit code, skipping the interpreter's teardown of Prefect's modules: 0.5-1 s of
    work nobody waits for, after a command whose user already has its result."""
    if _EXIT_CODE:
        with contextlib.suppress(Exception):
            if "logging" in sys.modules:  # its own exit handler may have been registered before this one
                sys.modules["logging"].shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(_EXIT_CODE[0])


if __name__ == "__main__":
    entrypoint()
