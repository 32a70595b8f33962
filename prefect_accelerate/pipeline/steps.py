"""The preflight steps as plain functions (no Prefect): the tasks wrap them, benches call them directly.

Each step returns a pydantic result or raises PreflightError whose message names the step and the fix.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from prefect_accelerate.errors import PreflightError, PrefectAccelerateError, UsageError
from prefect_accelerate.pipeline.graph import deepspeed_json_path, estimate_options, launch_options
from prefect_accelerate.pipeline.models import PipelineRequest


class ConfigCheck(BaseModel):
    """What the config step found: the file, how it was read, and the launch it leads to."""

    config_path: str | None
    config_source: str | None
    distributed_type: str | None
    launcher: str
    num_processes: int
    num_machines: int
    mixed_precision: str
    notes: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)


def config_step(request: PipelineRequest) -> ConfigCheck:
    """Load (migrating an old format in memory) and validate the config together with the launch flags."""
    from prefect_accelerate.launchers import choose_launcher, plan_launch

    options = launch_options(request)
    plan = plan_launch(options, cwd=request.cwd)
    return ConfigCheck(
        config_path=options.config_path, config_source=options.config_source, distributed_type=options.distributed_type,
        launcher=choose_launcher(options), num_processes=int(options.num_processes), num_machines=int(options.num_machines),
        mixed_precision=str(options.mixed_precision), notes=list(plan.notes), warnings=list(plan.warnings),
    )


def env_step():
    from prefect_accelerate.envreport.probe import collect_env_report

    return collect_env_report(None, check_imports=True)


def memory_step(request: PipelineRequest):
    from prefect_accelerate.memory.core import estimate

    return estimate(request.model, estimate_options(request, launch_options(request)))


def device_memory_for(request: PipelineRequest, estimate) -> tuple[int | str, str]:
    """One device's memory: given, else the smallest CUDA device, else this machine's RAM per local process."""
    if request.memory.device_memory:
        return request.memory.device_memory, "given"
    from prefect_accelerate.launchers.host import local_host

    if local_host().accelerator_kind() == "cuda":
        from prefect_accelerate.memory.fit import detect_device_memory

        return detect_device_memory()
    import psutil

    per_node = max(estimate.options.num_processes // estimate.options.num_machines, 1)
    total = psutil.virtual_memory().total
    return total // per_node, f"CPU training: system RAM shared by {per_node} process(es) on this machine"


def memory_fit_verdict(request: PipelineRequest, estimate):
    """The fit verdict, whichever way it goes; `device_source` says where the device size came from."""
    from prefect_accelerate.memory.fit import check_fit

    memory, source = device_memory_for(request, estimate)
    if request.memory.measure:
        from prefect_accelerate.memory.fit import check_measured
        from prefect_accelerate.memory.probe import measure
        from prefect_accelerate.memory.units import parse_memory_size

        # the budget caps the probe's address space on CPU; on a GPU the device itself is the limit
        measured = measure(estimate, device="auto", device_memory=parse_memory_size(memory))
        return check_measured(estimate, measured, memory).model_copy(update={"device_source": source})
    return check_fit(estimate, memory).model_copy(update={"device_source": source})


def fit_failure_message(verdict) -> str:
    # the verdict's message already names the smallest change that fits
    return f"{verdict.message} Device memory: {device_source_text(verdict.device_source)}."


def memory_fit_step(request: PipelineRequest, estimate):
    verdict = memory_fit_verdict(request, estimate)
    if not verdict.fits:
        raise PreflightError(fit_failure_message(verdict))
    return verdict


def device_source_text(source: str) -> str:
    """Where one device's size came from, in words ("given" is the size the user passed)."""
    return "the size you passed (--device_memory)" if source == "given" else source


def deepspeed_step(request: PipelineRequest, estimate=None):
    from prefect_accelerate.launchers.engines.deepspeed.check import check_deepspeed, settings_from_options

    options = launch_options(request)
    if options.deepspeed_config_file:
        from prefect_accelerate.memory.strategies import deepspeed_json_settings

        try:  # the file DeepSpeed will read: a broken one stops the preflight here, with its file and field
            deepspeed_json_settings(deepspeed_json_path(request, options))
        except UsageError as error:
            raise PreflightError(f"The DeepSpeed check failed: {error}") from None
    settings = settings_from_options(options, cwd=request.cwd)
    per_node = max(int(options.num_processes) // int(options.num_machines), 1)
    params = {}
    if estimate is not None and estimate.profile is not None:
        params = {"total_params": estimate.profile.parameters, "largest_layer_params": estimate.profile.largest_module_parameters}
    check = check_deepspeed(
        zero_stage=int(settings.get("zero_stage") or 0), gpus_per_node=per_node, num_nodes=int(options.num_machines),
        offload_optimizer_device=settings.get("offload_optimizer_device"), offload_param_device=settings.get("offload_param_device"),
        zero3_init=bool(settings.get("zero3_init", True)), **params,
    )
    if not check.ok:
        raise PreflightError("The DeepSpeed check failed: " + " ".join(check.problems))
    return check


def install_test_step(request: PipelineRequest, timeout: float = 600.0, on_line=None):
    """The self-test through the same launcher, config and flags the training launch will use."""
    from prefect_accelerate.launchers import plan_launch
    from prefect_accelerate.launchers.execute import execute
    from prefect_accelerate.selftest import parse_selftest_output, selftest_options

    flags = {k: v for k, v in request.launch_flags.items() if k not in ("module", "no_python")}
    options = selftest_options(request.config_file, **flags)
    plan = plan_launch(options, cwd=request.cwd)
    lines: list[str] = []

    def keep(label: str, line: str) -> None:
        lines.append(line)
        if on_line is not None:
            on_line(label, line)

    result = execute(plan, on_line=keep, timeout=timeout)
    report = parse_selftest_output(lines)
    if not (result.succeeded and report.success):
        failed = [c for c in report.checks if not c.passed]
        reason = f"check {failed[0].name} failed on rank(s) {failed[0].ranks}: {failed[0].detail}" if failed else result.failure_message()
        raise PreflightError(f"The install self-test failed: {reason}. Log: {result.log_path}.")
    return report


def failure_exit_code(error: object) -> int:
    """The exit code a failed step passes on: its own error's (2 for a bad input), else 1."""
    return error.exit_code if isinstance(error, PrefectAccelerateError) else 1


def failure_text(error: BaseException) -> str:
    if isinstance(error, PrefectAccelerateError):
        return error.message
    return f"{type(error).__name__}: {error}"
