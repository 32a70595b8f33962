"""`prefect-accelerate env`: what this machine has, pasteable into a bug report (reference §2.4)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from prefect_accelerate.cli.tracking import add_tracking_flags, should_track
from prefect_accelerate.config.paths import ConfigLocation

DESCRIPTION = (
    "Print the lines `accelerate env` prints (with prefect-accelerate's version and Accelerate's own), plus the "
    "Prefect version and API URL, the CUDA stack, every accelerator, CPU cores, which optional engines import, "
    "and the Accelerate config in use."
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("env", help="Print environment information for a bug report.", description=DESCRIPTION)
    parser.add_argument(
        "--config_file", default=None,
        help="The config file to show (default: $HF_HOME/accelerate/default_config.yaml, or a legacy default_config.json there).",
    )
    parser.add_argument("--json", action="store_true", help="Print the structured report as JSON instead of text.")
    parser.add_argument(
        "--no_import_check", dest="check_imports", action="store_false",
        help="Report the installed versions of the optional engines without importing them (about 3 s faster).",
    )
    add_tracking_flags(parser, tracked_by_default=False)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if should_track(args):
        from prefect_accelerate.flows.check import env_flow

        # pass the flag only when given, so the flow's own default stays the single source of it
        extra = {} if args.check_imports else {"check_imports": False}
        report = env_flow(config_file=args.config_file, **extra)
    else:
        from prefect_accelerate.envreport.probe import collect_env_report

        report = collect_env_report(args.config_file, check_imports=args.check_imports)
    if args.config_file is None and report.config.path is not None and report.config.source is not None:
        # say which default file was read: a stale default used silently is a known complaint (reference §10.1)
        print(ConfigLocation(Path(report.config.path), report.config.source).describe(), file=sys.stderr)
    if args.json:
        print(report.model_dump_json(indent=2))
    else:
        from prefect_accelerate.envreport.render import render_text

        print(render_text(report))
    return 0
