"""`prefect-accelerate to-fsdp2`: convert an FSDP1 config file to FSDP2."""

from __future__ import annotations

import argparse

from prefect_accelerate.cli.tracking import add_tracking_flags, should_track


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "to-fsdp2", help="Convert an Accelerate config from FSDP1 to FSDP2.",
        description="Convert an Accelerate config from FSDP1 to FSDP2 (fsdp_sharding_strategy becomes fsdp_reshard_after_forward; FSDP1-only keys are dropped).",
    )
    parser.add_argument("--config_file", required=True, help="The FSDP1 config file to convert.")
    parser.add_argument("--overwrite", action="store_true", default=False, help="Replace the output file if it exists; without --output_file, convert in place.")
    parser.add_argument("--output_file", default=None, help="Where to write the converted config.")
    add_tracking_flags(parser, tracked_by_default=False)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if should_track(args):
        from prefect_accelerate.flows.config import to_fsdp2_flow

        result = to_fsdp2_flow(config_file=args.config_file, output_file=args.output_file, overwrite=args.overwrite)
    else:
        from prefect_accelerate.config.fsdp2 import convert_to_fsdp2

        result = convert_to_fsdp2(args.config_file, args.output_file, overwrite=args.overwrite)
    print(result.message())
    return 0
