"""`prefect-accelerate test`: launch the bundled distributed self-test through the real launcher."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from prefect_accelerate.cli.tracking import add_tracking_flags

    parser = subparsers.add_parser(
        "test", help="Run a distributed self-test with your config, through the real launcher.",
        description=(
            "Launch prefect-accelerate's self-test with the given config: process group, collectives, RNG sync, "
            "data sharding, a few training steps, mixed precision and Accelerator() are checked on every process."
        ),
    )
    parser.add_argument("--config_file", default=None, help="The config to test (default: the default config, if any).")
    parser.add_argument("--timeout", type=float, default=600.0, help="Stop the self-test after this many seconds (default 600).")
    add_tracking_flags(parser, tracked_by_default=True)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from prefect_accelerate.cli.tracking import should_track

    if should_track(args):
        from prefect_accelerate.flows.selftest import install_test_flow

        report = install_test_flow(config_file=args.config_file, timeout=args.timeout)
        print(report.summary())
        return 0
    from prefect_accelerate.launchers import plan_launch
    from prefect_accelerate.launchers.execute import execute
    from prefect_accelerate.selftest import parse_selftest_output, selftest_options

    options = selftest_options(args.config_file)
    plan = plan_launch(options)
    for note in plan.notes:
        print(f"[prefect-accelerate] {note}", file=sys.stderr)
    print(f"Running: {plan.command_line()}", file=sys.stderr)
    lines: list[str] = []

    def show(label: str, line: str) -> None:
        lines.append(line)
        if "[selftest]" in line or "Error" in line or "Traceback" in line:
            print(line, flush=True)

    result = execute(plan, on_line=show, timeout=args.timeout)
    report = parse_selftest_output(lines)
    if result.succeeded and report.success:
        return 0
    failed = [c for c in report.checks if not c.passed]
    if failed:
        first = failed[0]
        print(f"error: the self-test failed: check {first.name} on rank(s) {first.ranks or '?'}: {first.detail}", file=sys.stderr)
    result.raise_for_failure()
    return 3
