"""A Prefect block with a Slurm cluster's defaults, so flows and deployments name a cluster instead of flags.

    SlurmClusterBlock(partition="gpu", account="ml", setup_lines=["module load cuda/12.4", "source /shared/venv/bin/activate"],
                      sbatch_args=["--exclusive"]).save("my-cluster")
    prefect-accelerate launch --slurm --slurm_block my-cluster --num_machines 4 train.py

Flags given on the command line win over the block's values. The Accelerate config file gets no new keys.
"""

from __future__ import annotations

from typing import Any

from prefect.blocks.core import Block
from pydantic import Field


class SlurmClusterBlock(Block):
    """Defaults for jobs on one Slurm cluster: partition, account, setup lines, extra sbatch options."""

    _block_type_name = "Accelerate Slurm Cluster"
    _block_type_slug = "accelerate-slurm-cluster"

    partition: str | None = Field(default=None, description="sbatch --partition")
    account: str | None = Field(default=None, description="sbatch --account")
    qos: str | None = Field(default=None, description="sbatch --qos")
    time: str | None = Field(default=None, description="sbatch --time, e.g. 04:00:00")
    gpus_per_node: int | None = Field(default=None, description="sbatch --gpus-per-node")
    setup_lines: list[str] = Field(default_factory=list, description="Shell lines run in the batch script before the launch (module load, venv activation)")
    sbatch_args: list[str] = Field(default_factory=list, description="More sbatch options, one per item (e.g. --exclusive)")
    pending_timeout: float | None = Field(default=None, description="Cancel the job and fail if it is still pending after this many seconds")


def load_cluster_block(name: str) -> dict[str, Any]:
    """The saved block's values as a dict; a missing block is one paragraph naming it and how to save one."""
    from prefect_accelerate.errors import ConfigError

    try:
        block = SlurmClusterBlock.load(name)
    except ValueError as error:
        raise ConfigError(
            f"No SlurmClusterBlock named {name!r} was found ({error}). Save one first, e.g. in Python: "
            f"SlurmClusterBlock(partition='gpu', account='ml').save({name!r}), or drop --slurm_block."
        ) from None
    return block.model_dump(exclude={"block_type_slug"}, exclude_none=True)
