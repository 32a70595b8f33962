"""`prefect-accelerate merge-weights`: a sharded FSDP checkpoint to `model.safetensors` (or shards with an index)."""

from __future__ import annotations

import argparse

from prefect_accelerate.cli.tracking import add_tracking_flags, should_track

DESCRIPTION = (
    "Merge the weights of a sharded FSDP checkpoint (a torch Distributed Checkpoint folder with `.metadata` and "
    "`*.distcp` files, as Accelerate's `save_state` writes under SHARDED_STATE_DICT, e.g. `<dir>/pytorch_model_fsdp_0`) "
    "into OUTPUT_DIR/model.safetensors. Runs on CPU without a process group. Models above --max_shard_size are written "
    "in shards with model.safetensors.index.json. Every file is read back and checked before it is put in place."
)
# transformers' save_pretrained default; kept here too so `--help` needs no import of the merge package
DEFAULT_MAX_SHARD_SIZE = "50GB"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("merge-weights", help="Merge a sharded FSDP checkpoint into one weights file.", description=DESCRIPTION)
    parser.add_argument("checkpoint_directory", metavar="CHECKPOINT_DIR", help="The checkpoint folder, e.g. `<save_state dir>/pytorch_model_fsdp_0`.")
    parser.add_argument("output_path", metavar="OUTPUT_DIR", help="Where to write the merged weights; created with its parents.")
    parser.add_argument(
        "--unsafe_serialization", action="store_true", default=False,
        help="Write pytorch_model.bin (pickle) instead of model.safetensors (not recommended).",
    )
    parser.add_argument(
        "--remove_checkpoint_dir", action="store_true", default=False,
        help="Delete CHECKPOINT_DIR once the merged weights are written and verified.",
    )
    parser.add_argument(
        "--max_shard_size", default=DEFAULT_MAX_SHARD_SIZE, metavar="SIZE",
        help=f"Write shards with an index above this size, like transformers' save_pretrained, e.g. 5GB, 500MB, 2GiB (default: {DEFAULT_MAX_SHARD_SIZE}).",
    )
    add_tracking_flags(parser, tracked_by_default=True)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    options = {
        "unsafe_serialization": args.unsafe_serialization,
        "remove_checkpoint_dir": args.remove_checkpoint_dir,
        "max_shard_size": args.max_shard_size,
    }
    if should_track(args):
        from prefect_accelerate.merge import check_merge

        # a wrong folder or flag is reported before Prefect starts (its server takes seconds), and plainly
        check_merge(args.checkpoint_directory, args.output_path, **options)
        from prefect_accelerate.flows.merge import merge_weights_flow

        result = merge_weights_flow(checkpoint_dir=args.checkpoint_directory, output_dir=args.output_path, **options)
    else:
        from prefect_accelerate.merge import StderrProgress, merge_weights

        result = merge_weights(args.checkpoint_directory, args.output_path, on_progress=StderrProgress(), **options)
    print(result.message())
    return 0
