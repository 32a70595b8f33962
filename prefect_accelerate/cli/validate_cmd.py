"""`prefect-accelerate validate PATH_OR_GLOB ...`: preflight over many config files (the scheduled validation)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from prefect_accelerate.cli.tracking import add_tracking_flags, should_track


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "validate", help="Preflight many config files (files, folders or globs); non-zero exit if any fails.",
        description="Check each config file: it loads, its launch plans, the model fits (with --model) and the self-test "
        "passes through the real launcher. Unchanged configs come from the cache.",
    )
    parser.add_argument("configs", nargs="+", help="Config files, folders holding them, or glob patterns.")
    parser.add_argument("--model", default=None, help="Model to size against each config's layout.")
    parser.add_argument("--device_memory", default=None, help="Memory of one device for the fit check, e.g. 80GiB.")
    parser.add_argument("--max_concurrency", type=int, default=2, help="Configs validated at once (default 2).")
    parser.add_argument("--no_install_test", dest="run_install_test", action="store_false", help="Skip the self-test launches.")
    parser.add_argument("--force", action="store_true", help="Re-validate even unchanged configs.")
    add_tracking_flags(parser, tracked_by_default=True)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from prefect_accelerate.pipeline.models import MemorySettings, ValidationRequest

    request = ValidationRequest(
        configs=args.configs, model=args.model, memory=MemorySettings(device_memory=args.device_memory),
        run_install_test=args.run_install_test, max_concurrency=args.max_concurrency, force=["all"] if args.force else [],
    )
    from prefect_accelerate.pipeline.validate import expand_configs

    # the inputs first: a pattern that matches nothing is one line of error, before any Prefect server starts
    expand_configs(request.configs)
    if should_track(args):
        from prefect_accelerate.errors import PreflightError
        from prefect_accelerate.flows.validate import validate_configs

        state = validate_configs(request=request, return_state=True)
        outcome = state.result(raise_on_failure=False)
        if isinstance(outcome, PreflightError):  # one paragraph; Prefect printed no traceback before it
            print(f"error: {outcome.message}", file=sys.stderr)
            return 1
        if isinstance(outcome, BaseException):
            raise outcome
        results = outcome.configs
    else:
        from prefect_accelerate.pipeline.validate import validate_one

        results = [validate_one(path, request) for path in expand_configs(request.configs)]
    for result in results:
        print(f"{'ok  ' if result.ok else 'FAIL'} {Path(result.config_file).name}: {result.message}")
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"{len(failed)} of {len(results)} config(s) failed.", file=sys.stderr)
        return 1
    return 0
