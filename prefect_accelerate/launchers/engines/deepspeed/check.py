"""DeepSpeed preflight: is DeepSpeed usable here, on what, and do the ZeRO model states fit per device.

A pure function (no Prefect) for the pipeline's preflight step. The memory figures come from DeepSpeed's
own estimators (`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`), which
count parameters, gradients and Adam states with mixed precision; activations are not included
(prefect_accelerate.memory estimates those). DeepSpeed has no estimator for ZeRO stages 0 and 1.

    >>> check = check_deepspeed(model, zero_stage=3, gpus_per_node=8, num_nodes=2)
    >>> check.ok, check.accelerator, check.memory.per_device_bytes
"""

from __future__ import annotations

import json
import os
from typing import Any

from pydantic import BaseModel, Field

from prefect_accelerate.launchers.engines.deepspeed.plan import installed_deepspeed_version

#: the oldest DeepSpeed the launcher supports (Accelerate's nossh launcher needs --no_ssh from 0.14.5)
MIN_VERSION = (0, 14, 5)
#: DeepSpeed's estimators budget this much CPU memory for buffers on top of the states
DEFAULT_BUFFER_FACTOR = 1.5


class ZeroMemoryOption(BaseModel):
    """One row of DeepSpeed's estimate table: a placement of the states and what it needs."""

    offload_optimizer: bool
    offload_param: bool = False
    zero_init: bool = True
    per_device_bytes: int = Field(description="model states on each accelerator")
    per_node_cpu_bytes: int = Field(description="CPU memory on each machine")


class ZeroMemoryEstimate(BaseModel):
    """Model-state memory for a ZeRO stage, from DeepSpeed's estimators, for the chosen offload settings."""

    zero_stage: int
    total_params: int
    largest_layer_params: int | None = None
    gpus_per_node: int
    num_nodes: int
    offload_optimizer: bool
    offload_param: bool
    zero_init: bool
    per_device_bytes: int
    per_node_cpu_bytes: int
    #: every placement DeepSpeed's table lists for this stage (what the user could switch to)
    options: list[ZeroMemoryOption] = Field(default_factory=list)
    estimator: str


class DeepSpeedCheck(BaseModel):
    """The preflight result. `ok` is False when DeepSpeed cannot be used; `problems` say why and what to do."""

    ok: bool
    installed: bool
    version: str | None = None
    accelerator: str | None = None
    communication_backend: str | None = None
    device_count: int | None = None
    memory: ZeroMemoryEstimate | None = None
    problems: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


def _model_params(model: Any) -> tuple[int, int]:
    """(total, largest layer) counted as DeepSpeed's estimators count them (shared tensors once)."""
    total = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
    largest = max((sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules()), default=0)
    return total, largest


def _offloaded(device: str | None) -> bool:
    return str(device or "none").lower() in ("cpu", "nvme")


def estimate_zero_memory(
    total_params: int,
    *,
    zero_stage: int,
    largest_layer_params: int | None = None,
    gpus_per_node: int = 1,
    num_nodes: int = 1,
    offload_optimizer_device: str | None = None,
    offload_param_device: str | None = None,
    zero3_init: bool = True,
    buffer_factor: float = DEFAULT_BUFFER_FACTOR,
) -> ZeroMemoryEstimate:
    """DeepSpeed's ZeRO-2/3 model-state estimate. Imports DeepSpeed; raises ValueError for stages 0 and 1."""
    common = dict(num_gpus_per_node=gpus_per_node, num_nodes=num_nodes, additional_buffer_factor=buffer_factor)
    offload_opt, offload_par = _offloaded(offload_optimizer_device), _offloaded(offload_param_device)
    if zero_stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as estimator

        def row2(opt: bool) -> ZeroMemoryOption:
            cpu, device = estimator(total_params, cpu_offload=opt, **common)
            return ZeroMemoryOption(offload_optimizer=opt, per_device_bytes=int(device), per_node_cpu_bytes=int(cpu))

        rows = [row2(opt) for opt in (True, False)]
        chosen = row2(offload_opt)
        offload_par, zero3_init = False, True
    elif zero_stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as estimator

        if largest_layer_params is None:
            raise ValueError("ZeRO-3 needs the largest layer's parameter count (pass a model, or largest_layer_params)")

        def row(opt: bool, par: bool, init: bool) -> ZeroMemoryOption:
            cpu, device, _ = estimator(total_params, largest_layer_params, cpu_offload=opt, cpu_offload_params=par, zero_init=init, **common)
            return ZeroMemoryOption(offload_optimizer=opt, offload_param=par, zero_init=init, per_device_bytes=int(device), per_node_cpu_bytes=int(cpu))

        # DeepSpeed's table (and estimator) offloads parameters only together with the optimizer
        rows = [row(opt, par, init) for opt, par in ((True, True), (True, False), (False, False)) for init in (True, False)]
        chosen = row(offload_opt or offload_par, offload_par, zero3_init)
        offload_opt = offload_opt or offload_par
    else:
        raise ValueError(f"DeepSpeed has memory estimators for ZeRO stages 2 and 3 only, not {zero_stage}")
    return ZeroMemoryEstimate(
        zero_stage=zero_stage, total_params=total_params, largest_layer_params=largest_layer_params if zero_stage == 3 else None,
        gpus_per_node=gpus_per_node, num_nodes=num_nodes, offload_optimizer=offload_opt, offload_param=offload_par,
        zero_init=zero3_init, per_device_bytes=chosen.per_device_bytes, per_node_cpu_bytes=chosen.per_node_cpu_bytes,
        options=rows, estimator=f"{estimator.__module__}.{estimator.__name__}",
    )


def settings_from_options(options, cwd: str | None = None) -> dict[str, Any]:
    """check_deepspeed keyword arguments from LaunchOptions (and the DeepSpeed JSON file they name, which wins)."""
    machines = int(options.num_machines or 1)
    settings: dict[str, Any] = {
        "zero_stage": options.zero_stage, "gpus_per_node": max(int(options.num_processes or 1) // machines, 1),
        "num_nodes": machines, "offload_optimizer_device": options.offload_optimizer_device,
        "offload_param_device": options.offload_param_device,
    }
    if options.zero3_init_flag is not None:
        settings["zero3_init"] = str(options.zero3_init_flag).lower() in ("true", "1", "yes")
    if options.deepspeed_config_file:
        path = os.path.join(cwd or os.getcwd(), str(options.deepspeed_config_file))
        try:
            with open(path, encoding="utf-8") as handle:
                zero = json.load(handle).get("zero_optimization", {})
        except (OSError, ValueError, AttributeError):
            zero = {}  # unreadable, or not an object: the deepspeed-check step reports it (pipeline/steps.py)
        if not isinstance(zero, dict):
            zero = {}
        for key, name in (("stage", "zero_stage"),):
            if isinstance(zero.get(key), int):
                settings[name] = zero[key]
        for key, name in (("offload_optimizer", "offload_optimizer_device"), ("offload_param", "offload_param_device")):
            if isinstance(zero.get(key), dict) and zero[key].get("device") not in (None, "auto"):
                settings[name] = zero[key]["device"]
    if settings["zero_stage"] is None:
        settings["zero_stage"] = 2  # Accelerate's DeepSpeed plugin default
    return settings


def check_deepspeed(
    model: Any = None,
    *,
    total_params: int | None = None,
    largest_layer_params: int | None = None,
    zero_stage: int = 2,
    gpus_per_node: int = 1,
    num_nodes: int = 1,
    offload_optimizer_device: str | None = None,
    offload_param_device: str | None = None,
    zero3_init: bool = True,
    device_memory_bytes: int | None = None,
) -> DeepSpeedCheck:
    """Check DeepSpeed for a launch and estimate the model states per device. Never raises for a missing DeepSpeed.

    Args:
        model: an nn.Module (parameters are counted, nothing is run); or give `total_params` (and
            `largest_layer_params` for ZeRO-3).
        zero_stage, offload_*_device, zero3_init: the ZeRO settings of the launch (`settings_from_options`).
        gpus_per_node, num_nodes: processes per machine and machines.
        device_memory_bytes: memory of one device; when given, a problem is reported if the states exceed it.

    Returns:
        DeepSpeedCheck: ok, version, accelerator and communication backend, memory estimate, problems.
    """
    problems: list[str] = []
    notes: list[str] = []
    version = installed_deepspeed_version()
    if version is None:
        return DeepSpeedCheck(ok=False, installed=False, problems=[
            "DeepSpeed is not installed. Install it with `pip install 'prefect-accelerate[deepspeed]'` (after torch, "
            "and with a constraints file so pip keeps your torch)."])
    version_text = ".".join(map(str, version))
    if version < MIN_VERSION:
        problems.append(f"DeepSpeed {version_text} is older than {'.'.join(map(str, MIN_VERSION))}, which prefect-accelerate "
                        "needs; upgrade it (`pip install -U deepspeed`).")
    try:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        device, backend, count = accelerator.device_name(), accelerator.communication_backend_name(), accelerator.device_count()
    except Exception as error:  # an install that imports but cannot start is the thing to report
        return DeepSpeedCheck(ok=False, installed=True, version=version_text, problems=[
            *problems, f"DeepSpeed is installed but could not start its accelerator ({type(error).__name__}: {error}). "
                       "Run `ds_report` for details."])
    if device == "cpu":
        notes.append(f"DeepSpeed runs on its CPU accelerator with {backend}; ZeRO stages 1-3 work, CUDA-only ops "
                     "(fused Adam without torch_adam, async I/O) do not.")
    memory = None
    if model is not None:
        total_params, largest = _model_params(model)
        largest_layer_params = largest if largest_layer_params is None else largest_layer_params
    if total_params is not None:
        if zero_stage in (2, 3):
            try:
                memory = estimate_zero_memory(
                    total_params, zero_stage=zero_stage, largest_layer_params=largest_layer_params, gpus_per_node=gpus_per_node,
                    num_nodes=num_nodes, offload_optimizer_device=offload_optimizer_device,
                    offload_param_device=offload_param_device, zero3_init=zero3_init)
            except ValueError as error:
                problems.append(f"No memory estimate: {error}.")
        else:
            notes.append(f"DeepSpeed has no memory estimator for ZeRO stage {zero_stage}; "
                         "`prefect-accelerate estimate-memory --strategy zero1` covers it.")
    if memory is not None and device_memory_bytes is not None and memory.per_device_bytes > device_memory_bytes:
        fitting = [o for o in memory.options if o.per_device_bytes <= device_memory_bytes]
        hint = (" An offload setting that fits: " + ", ".join(
            f"offload_optimizer={'cpu' if o.offload_optimizer else 'none'}"
            + (f", offload_param={'cpu' if o.offload_param else 'none'}, zero3_init={o.zero_init}" if zero_stage == 3 else "")
            for o in fitting[:1]) + ".") if fitting else (
            " Spread the model over more devices." if zero_stage == 3 else " Use ZeRO-3, offloading or more devices.")
        problems.append(
            f"ZeRO-{zero_stage} model states need {memory.per_device_bytes / 2**30:.2f} GiB per device, more than its "
            f"{device_memory_bytes / 2**30:.2f} GiB.{hint}")
    return DeepSpeedCheck(
        ok=not problems, installed=True, version=version_text, accelerator=device, communication_backend=backend,
        device_count=count, memory=memory, problems=problems, notes=notes,
    )
