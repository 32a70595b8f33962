"""Kubernetes: one Indexed Job (one pod per machine) and a headless Service, so pod 0 has a stable DNS name.

`plan.plan(options, host, cwd=..., run_dir=...)` (pure) builds the two manifests into a LaunchPlan;
`job.run_job(plan, ...)` submits them through the official `kubernetes` client and follows the job (the
engine table in launchers/engines names both); `job.KubernetesJobRun` is the job handle (submit, status,
logs of every pod, stop, result). `pod_entry` is what each pod runs first: it waits for pod 0's DNS name,
takes its node rank from JOB_COMPLETION_INDEX and then becomes the launch. Nothing here imports the
`kubernetes` client, torch or Prefect until a job is submitted.
"""
