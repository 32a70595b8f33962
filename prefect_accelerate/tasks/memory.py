"""Prefect tasks over the memory estimate (prefect_accelerate.memory): `estimate_memory` and the `memory_fit` gate.

`estimate_memory` is cached across runs under an explicit key: the model's config content, the options
and the versions that change the numbers (this package, transformers/timm/torch). Prefect's default
policy would key on the run, so each new flow run would build the model again.
"""

from __future__ import annotations

import hashlib
import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import PurePath
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from prefect_accelerate._version import __version__
from prefect_accelerate.errors import PreflightError
from prefect_accelerate.memory.choices import DEFAULT_RESERVE_FRACTION
from prefect_accelerate.memory.core import estimate
from prefect_accelerate.memory.fit import check_fit
from prefect_accelerate.memory.models import EstimateOptions, FitVerdict, MemoryEstimate
from prefect_accelerate.pipeline.steps import device_source_text
from prefect_accelerate.tasks.artifacts import estimate_markdown, fit_summary, verdict_markdown
from prefect_accelerate.memory.resolve import resolve_model

ESTIMATE_ARTIFACT_KEY = "memory-estimate"
FIT_ARTIFACT_KEY = "memory-fit"
_VERSIONED = ("transformers", "timm", "torch")


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "-"


def estimate_cache_key(model: str, options: EstimateOptions | None) -> str:
    """sha256 of the model's config content, the options and the versions that change the numbers.

    Resolving reads the config (local folder or HF cache); only a model found nowhere locally asks the Hub.
    """
    options = options or EstimateOptions()
    source = resolve_model(model, options.library_name)
    payload = {
        "config": source.config_sha256,
        "library": source.library,
        "options": options.model_dump(mode="json"),
        "prefect_accelerate": __version__,
        **{name: _package_version(name) for name in _VERSIONED},
    }
    return "estimate-memory-" + hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _cache_key_fn(context: Any, parameters: dict[str, Any]) -> str:
    return estimate_cache_key(parameters["model"], parameters.get("options"))


def _run_name(prefix: str):
    def name() -> str:
        from prefect.runtime import task_run

        params = task_run.parameters
        model = params.get("model") or getattr(params.get("estimate"), "model", "model")
        return f"{prefix}-{PurePath(str(model)).name or model}"

    return name


@task(name="estimate-memory", task_run_name=_run_name("estimate-memory"), cache_key_fn=_cache_key_fn,
      cache_expiration=None, persist_result=True)
def estimate_memory(model: str, options: EstimateOptions | None = None) -> MemoryEstimate:
    """Size a model without weights (Accelerate's table, plus the per-device breakdown when a strategy is set).

    Publishes a markdown artifact (key ``memory-estimate``). Cached across runs on the model's config
    content and the options.

    Args:
        model: a folder with config.json, a Hub repo id (HF cache first), or a timm architecture name.
        options: dtypes and the training layout; see `EstimateOptions`.

    Returns:
        The MemoryEstimate.
    """
    result = estimate(model, options)
    logger = get_run_logger()
    logger.info("Sized %s", result.source.describe())
    if result.breakdown is not None:
        logger.info("%s per device (%s)", result.breakdown.device_total, result.breakdown.strategy)
    create_markdown_artifact(key=ESTIMATE_ARTIFACT_KEY, markdown=estimate_markdown(result),
                             description=f"Memory needed by {result.source.name}")
    return result


@task(name="memory-fit", task_run_name=_run_name("memory-fit"), cache_policy=NO_CACHE)
def memory_fit(estimate: MemoryEstimate, device_memory: str | int | None = None, reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
               raise_on_failure: bool = True) -> FitVerdict:
    """Gate: does the run fit on one device? Fails the task with the verdict when it does not.

    Args:
        estimate: from `estimate_memory` with a strategy.
        device_memory: ``"80GiB"``, bytes, or None for the smallest CUDA device on the machine running the task.
        reserve_fraction: an extra share of the device kept back, on top of the modelled CUDA context and
            allocator fragmentation.
        raise_on_failure: False returns the verdict instead of failing (the CLI's tracked report).

    Raises:
        PreflightError: the run would not fit, or would be at risk (under 5% of the device left); the message is the verdict with the smallest change that fits.
    """
    verdict = check_fit(estimate, device_memory, reserve_fraction)
    create_markdown_artifact(key=FIT_ARTIFACT_KEY, markdown=verdict_markdown(verdict), description=fit_summary(verdict))
    logger = get_run_logger()
    if verdict.fits:
        logger.info(verdict.message)
    elif raise_on_failure:
        raise PreflightError(f"{verdict.message} Device memory: {device_source_text(verdict.device_source)}.")
    else:
        logger.warning(verdict.message)
    return verdict
