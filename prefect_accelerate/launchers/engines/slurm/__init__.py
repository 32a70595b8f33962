"""Slurm: one batch job that runs, on every allocated node, the per-node launch Accelerate would run there.

`plan.plan(options, host, cwd=..., run_dir=...)` (pure) writes the sbatch script and each node's command
into a LaunchPlan; `job.run_job(plan, ...)` submits it and follows the job (the engine table in
launchers/engines names both); `job.SlurmJobRun` is the job handle (submit or attach by job id, status,
output, wait, stop, result).
"""
