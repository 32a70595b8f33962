"""A served flow that launches two sleeping workers; tests/deployments/test_end_to_end.py cancels it."""

import os

from prefect import flow

from prefect_accelerate.flows.launch import end_launch_processes
from prefect_accelerate.launchers.options import build_launch_options
from prefect_accelerate.tasks.launch import launch


@flow(on_cancellation=[end_launch_processes], on_crashed=[end_launch_processes])
def sleepy_launch(pid_dir: str, worker: str) -> None:
    os.environ["WORKER_MODE"] = "sleep"
    os.environ["WORKER_PID_DIR"] = pid_dir
    options = build_launch_options(
        worker, cpu=True, num_processes=2, mixed_precision="no", num_machines=1, dynamo_backend="no", grace_period=10,
    )
    launch(options)


if __name__ == "__main__":
    sleepy_launch.serve(name="served")
