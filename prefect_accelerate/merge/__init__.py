"""Merge a sharded FSDP checkpoint (torch Distributed Checkpoint) into one weights file, or shards with an index.

The pure API, importable without Prefect (torch is imported when a checkpoint is read):

    from prefect_accelerate.merge import merge_weights

    result = merge_weights("out/pytorch_model_fsdp_0", "merged", max_shard_size="5GB")
    print(result.weights_path, result.total_bytes)
"""

from __future__ import annotations

from prefect_accelerate.merge.checkpoint import Checkpoint, CheckpointEntry, open_checkpoint
from prefect_accelerate.merge.checks import check_merge
from prefect_accelerate.merge.core import merge_weights
from prefect_accelerate.merge.progress import MergeProgress, StderrProgress
from prefect_accelerate.merge.result import MergedTensor, MergeResult
from prefect_accelerate.merge.shards import DEFAULT_MAX_SHARD_SIZE, format_size, parse_size

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "Checkpoint",
    "CheckpointEntry",
    "MergeProgress",
    "MergeResult",
    "MergedTensor",
    "StderrProgress",
    "check_merge",
    "format_size",
    "merge_weights",
    "open_checkpoint",
    "parse_size",
]
