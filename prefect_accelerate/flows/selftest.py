"""`install_test_flow`: the self-test as a tracked flow run (what `prefect-accelerate test` runs)."""

from __future__ import annotations

from prefect import flow

from prefect_accelerate.flows.launch import end_launch_processes
from prefect_accelerate.selftest import SelfTestReport
from prefect_accelerate.tasks.selftest import install_test


@flow(name="install-test", on_cancellation=[end_launch_processes], on_crashed=[end_launch_processes])
def install_test_flow(config_file: str | None = None, timeout: float = 600.0) -> SelfTestReport:
    return install_test(config_file, timeout)
