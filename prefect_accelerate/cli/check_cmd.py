"""`prefect-accelerate check`: the environment check flow (load or create the config, then `env`)."""

from __future__ import annotations

import argparse
import sys

from prefect_accelerate.cli.tracking import add_tracking_flags, should_track


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check", help="Load (or create) the config, then report on this machine, as a Prefect flow.",
        description=(
            "Run the check-environment flow: load the Accelerate config (writing a default one for this machine "
            "when none exists), then publish the environment report as an artifact."
        ),
    )
    parser.add_argument("--config_file", default=None, help="The config to check (default: the default config).")
    parser.add_argument("--no_create", action="store_true", help="Fail instead of writing a default config when none exists.")
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="no", help="Precision for a config written here.")
    add_tracking_flags(parser, tracked_by_default=True)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from prefect_accelerate.envreport.render import render_text

    if should_track(args):
        from prefect_accelerate.flows.check import check_environment

        report = check_environment(config_file=args.config_file, create_if_missing=not args.no_create, mixed_precision=args.mixed_precision)
    else:
        from prefect_accelerate.config.defaults import write_default_config
        from prefect_accelerate.config.io import load_config_file
        from prefect_accelerate.config.paths import config_missing
        from prefect_accelerate.envreport.probe import collect_env_report

        config_file = args.config_file
        if config_missing(config_file) and not args.no_create:
            created = write_default_config(config_file, args.mixed_precision)
            print(created.message())
        loaded = load_config_file(config_file)
        if loaded.location.source != "passed":
            print(loaded.location.describe(), file=sys.stderr)
        report = collect_env_report(str(loaded.path) if loaded.location.source == "passed" else None)
    print(render_text(report))
    return 0
