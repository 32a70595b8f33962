"""Model sizing without weights, per-device estimates for each strategy, and a fit verdict.

The pure API, importable without Prefect (and without torch until a model is built):

    from prefect_accelerate.memory import EstimateOptions, estimate, check_fit

    est = estimate("./my-model", EstimateOptions(strategy="zero3", num_processes=8, mixed_precision="bf16"))
    verdict = check_fit(est, "80GiB")
    measured = check_measured(est, measure(est), "80GiB")   # real steps in a child process

Names are loaded on first use so that importing this package stays cheap.
"""

from __future__ import annotations

from prefect_accelerate._lazy import lazy_getattr

_EXPORTS: dict[str, str] = {
    "estimate": "prefect_accelerate.memory.core",
    "check_fit": "prefect_accelerate.memory.fit",
    "check_measured": "prefect_accelerate.memory.fit",
    "measure": "prefect_accelerate.memory.probe",
    "MeasuredPeak": "prefect_accelerate.memory.models",
    "detect_device_memory": "prefect_accelerate.memory.fit",
    "resolve_model": "prefect_accelerate.memory.resolve",
    "device_breakdown": "prefect_accelerate.memory.strategies",
    "render_table": "prefect_accelerate.memory.table",
    "render_text": "prefect_accelerate.memory.report",
    "parse_memory_size": "prefect_accelerate.memory.units",
    "EstimateOptions": "prefect_accelerate.memory.models",
    "MemoryEstimate": "prefect_accelerate.memory.models",
    "FitVerdict": "prefect_accelerate.memory.models",
    "DeviceBreakdown": "prefect_accelerate.memory.models",
    "ModelProfile": "prefect_accelerate.memory.models",
    "ModelSource": "prefect_accelerate.memory.models",
}

__all__ = list(_EXPORTS)


__getattr__ = lazy_getattr('prefect_accelerate.memory', _EXPORTS)
