"""The `install_test` task: run the self-test through the real launcher, publish its checks."""

from __future__ import annotations

import os

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from prefect_accelerate.errors import PreflightError
from prefect_accelerate.launchers import plan_launch
from prefect_accelerate.launchers.execute import execute
from prefect_accelerate.selftest import SelfTestReport, parse_selftest_output, selftest_options

SELFTEST_ARTIFACT_KEY = "install-test"


@task(name="install-test", task_run_name="install-test", cache_policy=NO_CACHE, retries=0)
def install_test(config_file: str | os.PathLike[str] | None = None, timeout: float = 600.0, **launch_flags) -> SelfTestReport:
    """Launch the bundled self-test with the config (and launch flags) a training run would use.

    Raises:
        PreflightError: a check failed (the message names it and the rank), or the launch itself failed.
    """
    logger = get_run_logger()
    options = selftest_options(config_file, **launch_flags)
    plan = plan_launch(options)
    lines: list[str] = []

    def log_line(label: str, line: str) -> None:
        lines.append(line)
        logger.info("[%s] %s", label, line)

    result = execute(plan, on_line=log_line, timeout=timeout)
    report = parse_selftest_output(lines)
    create_markdown_artifact(key=SELFTEST_ARTIFACT_KEY, markdown=report.markdown(), description="prefect-accelerate self-test")
    if not (result.succeeded and report.success):
        failed = [c for c in report.checks if not c.passed]
        reason = f"check {failed[0].name} failed on rank(s) {failed[0].ranks}: {failed[0].detail}" if failed else result.failure_message()
        raise PreflightError(f"The install self-test failed: {reason}. Log: {result.log_path}.")
    logger.info(report.summary())
    return report
