"""`prefect-accelerate check`: the environment check flow (load or create the config, then `env`)."""

from __future__ import annotations

import argparse
import sys

from prefect_accelerate.cli.tracking import add_tracking_flags, should_track


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check", help="Load the config (writing a default one when there is none), then report on this machine, as a Prefect flow.",
        description=(
            "Run the check-environment flow: load the Accelerate config, then publish the environment report as an "
            "artifact. When the config file does not exist, check writes a default one for this machine (like "
            "`config default`) and says so; pass --no_create to fail instead."
        ),
    )
    parser.add_argument("--config_file", default=None, help="The config to check (default: the default config).")
    parser.add_argument("--no_create", action="store_true", help="Fail instead of writing a default config when none exists.")
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="no", help="Precision for a config written here.")
    add_tracking_flags(parser, tracked_by_default=True)
    parser.set_defaults(func=run)


def creation_notice(config_file: str | None) -> str:
    """What check is about to do when the config does not exist (printed before the file is written)."""
    from prefect_accelerate.config.paths import default_config_path

    path = config_file or default_config_path()
    return (f"No Accelerate config at {path}: writing a default one for this machine there "
            "(pass --no_create to fail instead).")


def run(args: argparse.Namespace) -> int:
    from prefect_accelerate.config.paths import config_missing
    from prefect_accelerate.envreport.render import render_text

    if config_missing(args.config_file) and not args.no_create:
        print(creation_notice(args.config_file), file=sys.stderr)
    if should_track(args):
        from prefect_accelerate.flows.check import check_environment

        report = check_environment(config_file=args.config_file, create_if_missing=not args.no_create, mixed_precision=args.mixed_precision)
    else:
        from prefect_accelerate.config.defaults import write_default_config
        from prefect_accelerate.config.io import load_config_file
        from prefect_accelerate.envreport.probe import collect_env_report

        config_file = args.config_file
        if config_missing(config_file) and not args.no_create:
            print(write_default_config(config_file, args.mixed_precision).message(), file=sys.stderr)
        loaded = load_config_file(config_file)
        if loaded.location.source != "passed":
            print(loaded.location.describe(), file=sys.stderr)
        report = collect_env_report(str(loaded.path) if loaded.location.source == "passed" else None)
    print(render_text(report))
    return 0
