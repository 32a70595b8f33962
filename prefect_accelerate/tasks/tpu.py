"""The `tpu_config` task: run set-up commands on every worker of a TPU pod, logged, with an artifact.

Never cached (it changes the pod); no retries by default (`tpu_config.with_options(retries=2)` when the
commands are idempotent). Call it from the flow's main thread so a cancellation stops gcloud.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from prefect_accelerate.tpu_config import TpuConfigRequest, TpuConfigResult, resolve_tpu_config, run_tpu_config

RESULT_ARTIFACT_KEY = "tpu-config-result"


def _run_name() -> str:
    from prefect.runtime import task_run

    params = task_run.parameters
    request = params.get("request")
    name = request.pod.name if request is not None else params.get("tpu_name") or "pod"
    return f"tpu-config-{name}"


def result_markdown(result: TpuConfigResult) -> str:
    return "\n".join([
        f"# tpu-config on `{result.pod}` ({result.zone})", "", "| | |", "|---|---|",
        f"| exit code | {result.exit_code} |", f"| duration | {result.duration_s:.1f} s |", f"| log | `{result.log_path}` |",
        "", "```", " ".join(result.command), "```",
    ])


@task(name="tpu-config", task_run_name=_run_name, retries=0, cache_policy=NO_CACHE, persist_result=False)
def tpu_config(
    request: TpuConfigRequest | None = None,
    *,
    config_file: str | None = None,
    tpu_name: str | None = None,
    tpu_zone: str | None = None,
    tpu_project: str | None = None,
    tpu_block: str | None = None,
    command: Sequence[str] | None = None,
    command_file: str | None = None,
    install_accelerate: bool = False,
    accelerate_version: str = "latest",
    install_prefect_accelerate: bool = False,
    prefect_accelerate_version: str = "latest",
    use_alpha: bool = False,
    timeout: float | None = None,
) -> TpuConfigResult:
    """Run commands on every worker of a TPU pod (`prefect-accelerate tpu-config`).

    Args:
        request: an already resolved request; otherwise built from the other arguments (as the CLI flags).
        timeout: stop gcloud after this many seconds.

    Returns:
        The result (gcloud's exit code 0). Raises LaunchError when gcloud fails.

    Example:
        >>> tpu_config(tpu_name="my-pod", tpu_zone="us-central2-b", command=["pip install -r requirements.txt"])  # doctest: +SKIP
    """
    from prefect.runtime import flow_run, task_run

    if request is None:
        request = resolve_tpu_config(
            config_file=config_file, tpu_name=tpu_name, tpu_zone=tpu_zone, tpu_project=tpu_project, tpu_block=tpu_block,
            use_alpha=use_alpha, command=list(command) if command else None, command_file=command_file,
            install_accelerate=install_accelerate, accelerate_version=accelerate_version,
            install_prefect_accelerate=install_prefect_accelerate, prefect_accelerate_version=prefect_accelerate_version,
        )
    logger = get_run_logger()
    logger.info("Running %s", " ".join(request.argv()))
    result = run_tpu_config(
        request, on_line=lambda label, line: logger.info("%s", line), timeout=timeout,
        flow_run_id=str(flow_run.id) if flow_run.id else None, task_run_id=str(task_run.id) if task_run.id else None,
    )
    create_markdown_artifact(key=RESULT_ARTIFACT_KEY, markdown=result_markdown(result), description="prefect-accelerate tpu-config result")
    logger.info("Successfully setup pod.")
    return result
