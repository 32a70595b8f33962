"""`estimate(model, options)`: the one entry point the CLI, the Prefect task and the preflight flow call."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

from prefect_accelerate._version import __version__
from prefect_accelerate.errors import EstimateError, UsageError, broken_imports_reported
from prefect_accelerate.memory.models import ActivationProfile, EstimateOptions, MemoryEstimate, ModelProfile, ModelSource
from prefect_accelerate.memory import profile_cache
from prefect_accelerate.memory.lean_imports import hidden_for
from prefect_accelerate.memory.resolve import resolve_model


def estimate(model: str | ModelSource, options: EstimateOptions | None = None, *, cache: bool = False,
             lean_imports: bool = False) -> MemoryEstimate:
    """Size a model without weights: Accelerate's table, plus the per-device breakdown when a strategy is set.

    Args:
        model: a folder holding config.json, a Hub repo id (the local cache first), a timm architecture
            name, or a `ModelSource` from `resolve_model`.
        options: dtypes for the table, and the training layout for the breakdown (``strategy=None``
            gives the table only).

        cache: reuse (and keep) what an earlier build and trace measured for the same config, versions and
            traced options (memory/profile_cache.py): a hit imports neither torch nor transformers.
        lean_imports: for a command that owns its process: keep the optional libraries a text model never
            uses (torchvision, scipy, boto3) out of transformers' import (memory/lean_imports.py). transformers
            remembers they were absent for the rest of the process, so the library API leaves it off.

    Returns:
        A MemoryEstimate; ``.breakdown`` is set when ``options.strategy`` is.

    Raises:
        EstimateError: the model cannot be found or built (message says which and how to fix it).
        DependencyError: transformers or timm is needed and missing, or a library they import fails to import.
        UsageError: the layout cannot run (for example ``--offload optimizer`` with DDP).

    Example:
        >>> est = estimate("./my-model", EstimateOptions(strategy="zero3", num_processes=8, mixed_precision="bf16"))
        >>> est.breakdown.device_total
    """
    from prefect_accelerate.memory.build import build_table_model, quiet_libraries  # no torch import until called
    from prefect_accelerate.memory.sizing import table_sizes
    from prefect_accelerate.memory.strategies import device_breakdown, validate_layout
    from prefect_accelerate.memory.table import build_table

    options = options or EstimateOptions()
    if options.strategy is not None:
        validate_layout(options)  # before any slow work
    name = model.name if isinstance(model, ModelSource) else model
    # a library that is installed but cannot import (a torchvision built for another torch, say) is a
    # one-paragraph error naming it, not a traceback from deep inside transformers or timm
    with broken_imports_reported(f"Sizing `{name}`"):
        source = model if isinstance(model, ModelSource) else resolve_model(model, options.library_name)
        key = profile_cache.cache_key(source, options) if cache else None
        kept = profile_cache.load(key) if key else None
        if kept is not None and (options.strategy is None or kept.get("profile") is not None):
            measured_class, total, largest, names = kept["table"]
            profile = ModelProfile.model_validate(kept["profile"]) if options.strategy is not None else None
        else:
            # a command that owns its process hides the optional libraries this model never uses (memory/lean_imports.py)
            lean = hidden_for(source.library, source.config) if lean_imports else contextlib.nullcontext()
            with lean, quiet_libraries():
                table_model = build_table_model(source, options.trust_remote_code)
                total, largest, names = table_sizes(table_model)
                measured_class = type(table_model).__name__
                del table_model
                profile = measure_profile(source, options) if options.strategy is not None else None
            if key:
                profile_cache.store(key, {"table": [measured_class, total, largest, names],
                                          "profile": profile.model_dump(mode="json") if profile is not None else None})
        table = build_table(source.name, measured_class, total, largest, names, options.dtypes)
    autos = [name for name in ("reduce_bucket_size", "prefetch_bucket_size") if getattr(options, name) == "auto"]
    if autos:
        hidden = _auto_hidden(source, autos)
        # as Accelerate fills them in (Accelerator._prepare_deepspeed)
        filled = {"reduce_bucket_size": hidden * hidden, "prefetch_bucket_size": int(0.9 * hidden * hidden)}
        options = options.model_copy(update={name: filled[name] for name in autos})
    breakdown = device_breakdown(profile, options) if profile is not None else None
    return MemoryEstimate(model=source.name, source=source, options=options, table=table, profile=profile,
                          breakdown=breakdown, package_version=__version__)


def _auto_hidden(source: ModelSource, autos: list[str]) -> int:
    """The hidden size Accelerate fills DeepSpeed's "auto" buckets from (`Accelerator._prepare_deepspeed`): the
    config's hidden_size, or the largest of its hidden_sizes; a model with neither is refused there."""
    from prefect_accelerate.memory.strategies import DS_JSON_ELEMENTS

    config = source.config or {}
    hidden = config.get("hidden_size")
    if not isinstance(hidden, int) and isinstance(config.get("hidden_sizes"), list) and config["hidden_sizes"]:
        hidden = max(config["hidden_sizes"])
    if not isinstance(hidden, int):
        raise UsageError(
            f"The DeepSpeed config says `auto` for {', '.join(f'`zero_optimization.{DS_JSON_ELEMENTS[name][0][0]}`' for name in autos)}, which "
            f"Accelerate fills in from the model config's `hidden_size` (or `hidden_sizes`), and the config of "
            f"{source.name} has neither: Accelerate would refuse this launch. Replace `auto` with a number of elements "
            "(DeepSpeed's defaults: reduce_bucket_size 500000000, stage3_prefetch_bucket_size 50000000).")
    return hidden


def measure_profile(source: ModelSource, options: EstimateOptions) -> ModelProfile:
    """Build the trained class without weights, count it, and trace one forward for its activations."""
    from prefect_accelerate.memory.activations import trace_activations
    from prefect_accelerate.memory.choices import weight_dtype
    from prefect_accelerate.memory.build import build_trained_model, to_fake
    from prefect_accelerate.memory.depth import NotOneCallPerBlock, builds_the_prefix, shallow_plan
    from prefect_accelerate.memory.sizing import model_profile
    from prefect_accelerate.memory.strategies import precision_mode

    attention = None
    if source.library == "transformers":
        # the flag, else the config's own setting; None lets transformers pick (sdpa where the class supports it)
        raw = source.config or {}
        attention = options.attn_implementation or raw.get("attn_implementation") or raw.get("_attn_implementation")
    force_flash = attention == "flash_attention_2"
    build_attention = "sdpa" if force_flash else attention  # FA2 keeps what SDPA's flash kernel keeps
    model, class_name = build_trained_model(source, options.trust_remote_code, options.model_class,
                                            attn_implementation=build_attention)
    if force_flash and not (getattr(type(model), "_supports_flash_attn", False) or getattr(type(model), "_supports_flash_attn_2", False)):
        # transformers itself refuses flash attention for such a class (PreTrainedModel._check_and_adjust_attn_impl)
        raise EstimateError(
            f"`{class_name}` does not support flash_attention_2 in transformers (its `_supports_flash_attn` is False), so "
            "training could not run it. Use --attn_implementation sdpa or eager, or leave it out to get transformers' pick."
        )
    profile = model_profile(model, class_name)
    if not options.activations:
        return profile
    mode = precision_mode(options)
    dtype = weight_dtype(mode)
    full, layout = model, None
    plan = shallow_plan(model.config, model) if source.library == "transformers" else None
    if plan is not None:
        try:
            shallow, _ = build_trained_model(source, options.trust_remote_code, options.model_class, dtype,
                                             config=plan.config, attn_implementation=build_attention)
        except EstimateError:
            shallow = None  # the config refuses its shallow copy (a rule that sums its parts to the depth)
        if shallow is not None and builds_the_prefix(plan, shallow):
            model, layout = shallow, plan.layout

    def trace(model: Any, layout: list[int] | None) -> ActivationProfile:
        fake = to_fake(model)
        if options.gradient_checkpointing:
            _checkpointing_code_paths(fake)
        return trace_activations(fake, library=source.library, batch_size=options.batch_size,
                                 seq_len=options.seq_len, precision_mode=mode, layout=layout, force_flash=force_flash,
                                 device_type=options.device_type, capability=_capability(options),
                                 checkpointing=options.gradient_checkpointing)

    def whole_stack() -> Any:
        if dtype == "float32":
            return full
        config = full.config if source.library == "transformers" else None
        return build_trained_model(source, options.trust_remote_code, options.model_class, dtype, config=config,
                                   attn_implementation=build_attention)[0]

    try:
        activations = trace(model, layout) if layout else trace(whole_stack(), None)
    except NotOneCallPerBlock:
        activations = trace(whole_stack(), None)  # the shallow stack looped over part of itself
    if force_flash:
        activations = activations.model_copy(update={"attention_implementation": "flash_attention_2"})
    return profile.model_copy(update={"activations": activations})


def _run_through(function: Any, *args: Any, **kwargs: Any) -> Any:
    return function(*args, **kwargs)


def _checkpointing_code_paths(model: Any) -> None:
    """Turn on the model's own gradient-checkpointing switches, with a checkpoint function that just runs the block.

    A model's code may take another path under checkpointing: T5's attention makes its position bias a tensor that
    requires grad (so the checkpointed block passes a gradient through it), transformers turns the KV cache off.
    The trace then follows that path, while the blocks still run whole and save everything, as the trace needs;
    what checkpointing drops and recomputes is arithmetic over the per-block figures (strategies.py)."""
    setter = getattr(model, "_set_gradient_checkpointing", None)
    if setter is None or "gradient_checkpointing_func" not in inspect.signature(setter).parameters:
        return  # not a transformers model, or one with the old hook (it would checkpoint for real)
    setter(enable=True, gradient_checkpointing_func=_run_through)


def _capability(options: EstimateOptions) -> tuple[int, int] | None:
    if options.cuda_capability is None:
        return None
    major, minor = options.cuda_capability.split(".")
    return int(major), int(minor)
