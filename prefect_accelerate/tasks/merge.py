"""The `merge_weights` task: merge a sharded FSDP checkpoint, with progress in the logs and a table artifact."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from prefect_accelerate.merge import DEFAULT_MAX_SHARD_SIZE, MergeProgress, MergeResult, format_size
from prefect_accelerate.merge import merge_weights as merge_checkpoint

MERGE_ARTIFACT_KEY = "merge-weights"
PROGRESS_ARTIFACT_KEY = "merge-weights-progress"
#: rows in the table artifact; a 70B model has ~700 tensors, a big MoE many thousands
TABLE_ROW_LIMIT = 2000
LOG_EVERY_S = 5.0
ARTIFACT_EVERY_S = 1.0


def _merge_run_name() -> str:
    from prefect.runtime import task_run

    checkpoint = task_run.parameters.get("checkpoint_dir")
    return f"merge-weights-{Path(checkpoint).name}" if checkpoint else "merge-weights"


class TaskProgress:
    """Turn merge progress into run-log lines (every few seconds and at each phase) and a progress artifact.

    A failing artifact update (an API hiccup) is logged once and never stops the merge.
    """

    def __init__(self, logger: Any, *, log_every_s: float = LOG_EVERY_S, artifact_every_s: float = ARTIFACT_EVERY_S) -> None:
        self.logger = logger
        self.log_every_s = log_every_s
        self.artifact_every_s = artifact_every_s
        self.artifact_id: Any = None
        self._artifacts_ok = True
        self._last_log = self._last_artifact = float("-inf")
        self._phase = ""

    def __call__(self, progress: MergeProgress) -> None:
        now = time.monotonic()
        if progress.phase != self._phase or progress.phase == "done" or now - self._last_log >= self.log_every_s:
            self.logger.info("merge-weights: %s", progress.describe())
            self._last_log = now
            self._phase = progress.phase
        if progress.phase == "done" or now - self._last_artifact >= self.artifact_every_s:
            self._update_artifact(progress.fraction * 100)
            self._last_artifact = now

    def _update_artifact(self, percent: float) -> None:
        if not self._artifacts_ok:
            return
        try:
            if self.artifact_id is None:
                self.artifact_id = create_progress_artifact(percent, key=PROGRESS_ARTIFACT_KEY, description="merge-weights progress")
            else:
                update_progress_artifact(self.artifact_id, percent)
        except Exception as error:  # the merge matters more than its progress bar
            self._artifacts_ok = False
            self.logger.warning("merge-weights: could not update the progress artifact (%s); the merge goes on.", error)


@task(name="merge-weights", task_run_name=_merge_run_name, retries=0, cache_policy=NO_CACHE)
def merge_weights(
    checkpoint_dir: str | Path,
    output_dir: str | Path,
    unsafe_serialization: bool = False,
    remove_checkpoint_dir: bool = False,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> MergeResult:
    """Merge a sharded FSDP checkpoint folder into `model.safetensors` (or shards with an index).

    Args:
        checkpoint_dir: the DCP folder, e.g. `<save_state dir>/pytorch_model_fsdp_0`.
        output_dir: where to write; created with its parents.
        unsafe_serialization: write `pytorch_model.bin` instead of safetensors.
        remove_checkpoint_dir: delete the checkpoint folder once the output is written and verified.
        max_shard_size: shard above this size ("5GB", "500MB", or bytes).

    Returns:
        The MergeResult; the `merge-weights` table artifact lists every tensor, its dtype, shape and size.

    Raises:
        MergeError: a wrong or damaged checkpoint, or a failed write (nothing is left behind).
    """
    logger = get_run_logger()
    logger.info("Merging the sharded checkpoint %s into %s", checkpoint_dir, output_dir)
    result = merge_checkpoint(
        checkpoint_dir, output_dir, unsafe_serialization=unsafe_serialization, remove_checkpoint_dir=remove_checkpoint_dir,
        max_shard_size=max_shard_size, on_progress=TaskProgress(logger),
    )
    dtypes = ", ".join(f"{dtype} x{count}" for dtype, (count, _) in result.dtype_summary().items())
    create_table_artifact(
        key=MERGE_ARTIFACT_KEY, table=result.table_rows(limit=TABLE_ROW_LIMIT),
        description=f"Merged weights in {result.weights_path}: {len(result.tensors)} tensors ({dtypes}), {format_size(result.total_bytes)}",
    )
    logger.info(result.message())
    return result
