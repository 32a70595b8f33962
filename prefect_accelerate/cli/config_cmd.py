"""`prefect-accelerate config [default|update]`: write, create or migrate an Accelerate config file."""

from __future__ import annotations

import argparse
import sys

from prefect_accelerate.cli.tracking import add_tracking_flags, should_track

DESCRIPTION = (
    "Without a subcommand, ask the questions of `accelerate config` and write the answers to a config file. "
    "`config default` writes a config for this machine without questions; `config update` migrates an older "
    "file to the current format."
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("config", help="Create or update an Accelerate config file.", description=DESCRIPTION)
    parser.add_argument(
        "--config_file", default=None,
        help="Where to write the config (default: $HF_HOME/accelerate/default_config.yaml). A .json name gets JSON.",
    )
    parser.set_defaults(func=run_questionnaire)
    commands = parser.add_subparsers(title="subcommands", metavar="<subcommand>")

    default = commands.add_parser(
        "default", help="Write a config for this machine without asking questions.",
        description="Write a config for this machine (hardware detected through torch). An existing file is kept unless --force is given.",
    )
    default.add_argument("--config_file", default=None, help="Where to write (default: the default config path).")
    default.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="no", help="Mixed precision mode (default: no).")
    default.add_argument("--force", action="store_true", help="Replace an existing file; its old content is kept as <file>.bak.")
    add_tracking_flags(default, tracked_by_default=False)
    default.set_defaults(func=run_default)

    update = commands.add_parser(
        "update", help="Migrate a config file to the current format.",
        description="Migrate an older config file in place (atomically; the original is kept as <file>.bak) and list what changed.",
    )
    update.add_argument("--config_file", default=None, help="The file to update (default: the default config).")
    add_tracking_flags(update, tracked_by_default=False)
    update.set_defaults(func=run_update)


def run_default(args: argparse.Namespace) -> int:
    if should_track(args):
        from prefect_accelerate.flows.config import config_default_flow

        result = config_default_flow(config_file=args.config_file, mixed_precision=args.mixed_precision, force=args.force)
    else:
        from prefect_accelerate.config.defaults import write_default_config

        result = write_default_config(args.config_file, args.mixed_precision, force=args.force)
    print(result.message())
    return 0


def run_update(args: argparse.Namespace) -> int:
    if should_track(args):
        from prefect_accelerate.flows.config import config_update_flow

        result = config_update_flow(config_file=args.config_file)
    else:
        from prefect_accelerate.config.update import update_config_file

        result = update_config_file(args.config_file)
    if args.config_file is None:
        print(result.location.describe(), file=sys.stderr)
    print(result.message())
    return 0


def run_questionnaire(args: argparse.Namespace) -> int:
    from prefect_accelerate.config.questionnaire import run_questionnaire as ask

    path = ask(config_file=args.config_file)
    print(f"accelerate configuration saved at {path}")
    return 0
