"""Slurm: one batch job that runs, on every allocated node, the per-node launch Accelerate would run there.

`plan(options, host, cwd=..., run_dir=...)` (pure) writes the sbatch script and each node's command into a
LaunchPlan; `run(plan, ...)` submits it and follows the job; `SlurmJobRun` is the job handle (submit or
attach by job id, status, output, wait, stop, result).
"""

from __future__ import annotations

from prefect_accelerate.launchers.engines.slurm.plan import plan


def run(plan, **kwargs):  # noqa: ANN001, ANN201 - see job.run_job
    from prefect_accelerate.launchers.engines.slurm.job import run_job

    return run_job(plan, **kwargs)


__all__ = ["plan", "run"]
