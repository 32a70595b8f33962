"""A one-task flow for `merge-weights`, so the tracked CLI path is recorded as a flow run."""

from __future__ import annotations

from prefect import flow

from prefect_accelerate.merge import DEFAULT_MAX_SHARD_SIZE, MergeResult
from prefect_accelerate.tasks.merge import merge_weights


@flow(name="merge-weights", log_prints=True)
def merge_weights_flow(
    checkpoint_dir: str,
    output_dir: str,
    unsafe_serialization: bool = False,
    remove_checkpoint_dir: bool = False,
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
) -> MergeResult:
    """Merge a sharded FSDP checkpoint; see `prefect_accelerate.tasks.merge.merge_weights`."""
    return merge_weights(checkpoint_dir, output_dir, unsafe_serialization, remove_checkpoint_dir, max_shard_size)
