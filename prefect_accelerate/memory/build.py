"""Build models without weights: Accelerate's model for the table, and the model that will really be trained.

Two builds on purpose (docs/memory.md, "What is counted"):

- **Table model.** Accelerate builds `AutoModel` (the base model, no head) unless the config's
  ``auto_map`` names an ``AutoModelFor*`` class, inside ``init_empty_weights()``. That context stores a
  fresh meta Parameter each time a parameter is registered, so weights the model ties by assignment
  (T5's shared embedding) become separate tensors and are counted again. The table keeps Accelerate's
  numbers, so we build the same class with the same registration behaviour, all on the meta device
  (which is also why it is fast: nothing is allocated, buffers included).
- **Trained model.** The class from the config's ``architectures`` (``GPT2LMHeadModel``,
  ``T5ForConditionalGeneration``...), with its head and its ties intact, on the meta device. For the
  activation trace a copy is switched to fake CPU tensors (`to_fake`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from prefect_accelerate.errors import DependencyError, EstimateError, failed_import
from prefect_accelerate.memory.models import ModelSource

_HEAD_AUTO_CLASSES = (
    "AutoModelForCausalLM",
    "AutoModelForSeq2SeqLM",
    "AutoModelForMaskedLM",
    "AutoModelForImageClassification",
)


def _import_transformers(source: ModelSource) -> Any:
    try:
        import transformers
    except ImportError:
        raise DependencyError.missing("transformers", "transformers", f"Sizing the transformers model `{source.name}`") from None
    return transformers


def _import_timm(source: ModelSource) -> Any:
    try:
        import timm
    except ImportError:
        raise DependencyError.missing("timm", "timm", f"Sizing the timm model `{source.name}`") from None
    return timm


@contextlib.contextmanager
def fresh_parameter_registration() -> Iterator[None]:
    """Meta device, and a new Parameter object stored at every registration (Accelerate's `init_empty_weights` counting)."""
    import torch

    register = torch.nn.Module.register_parameter

    def register_fresh(module: torch.nn.Module, name: str, param: Any) -> None:
        register(module, name, param)
        stored = module._parameters.get(name)
        if stored is not None:
            fresh = torch.nn.Parameter(stored.detach().to("meta"), requires_grad=stored.requires_grad)
            fresh.__dict__.update(stored.__dict__)
            module._parameters[name] = fresh

    torch.nn.Module.register_parameter = register_fresh  # type: ignore[method-assign]
    try:
        with torch.device("meta"):
            yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Silence transformers' advice and torch's fake-tensor tracebacks while we build and trace.

    Our own report says what matters; a failed trace is reported as "not estimated" with its reason.
    """
    import logging

    fake_logger = logging.getLogger("torch._subclasses.fake_tensor")
    fake_level = fake_logger.level
    fake_logger.setLevel(logging.CRITICAL)
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:
        transformers_logging = None
    verbosity = transformers_logging.get_verbosity() if transformers_logging else None
    if transformers_logging:
        transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        fake_logger.setLevel(fake_level)
        if transformers_logging:
            transformers_logging.set_verbosity(verbosity)


# ---------------------------------------------------------------------------------------------- transformers


def load_transformers_config(source: ModelSource, trust_remote_code: bool) -> Any:
    transformers = _import_transformers(source)
    location = source.name if source.kind == "hub" else source.location
    try:
        return transformers.AutoConfig.from_pretrained(location, trust_remote_code=trust_remote_code)
    except ValueError as error:
        text = str(error)
        if "trust_remote_code" in text:
            raise EstimateError(
                f"`{source.name}` ships its own modeling code (config.json has an `auto_map`), which runs only "
                "with `--trust_remote_code`. Read that code first, then pass `--trust_remote_code` (Python: "
                "EstimateOptions(trust_remote_code=True))."
            ) from None
        if "Unrecognized model" in text or "model_type" in text or "model type" in text:
            model_type = (source.config or {}).get("model_type")
            raise EstimateError(
                f"transformers {transformers.__version__} does not know the model type "
                f"`{model_type}` named in the config of `{source.name}` ({source.location}). Upgrade "
                "transformers, fix `model_type` in config.json, or pass `--trust_remote_code` if the repo "
                "ships its own code."
            ) from None
        raise EstimateError(f"transformers could not read the config of `{source.name}` ({source.location}): {text}") from None
    except Exception as error:  # noqa: BLE001 - the config class's own validation (huggingface_hub's strict
        # dataclass errors are no ValueError), a missing file, a field of the wrong type: the config is the input
        broken = failed_import(error)
        if broken is not None:
            raise DependencyError.broken(broken[0], broken[1], f"Reading the config of `{source.name}`") from None
        text = " ".join(str(error).split())
        raise EstimateError(
            f"transformers could not read the config of `{source.name}` ({source.location}): "
            f"{type(error).__name__}: {text.rstrip('.')}. Check config.json, or rewrite it with `config.save_pretrained`."
        ) from None


def _dtype_kwargs(dtype: str = "float32") -> dict[str, Any]:
    import torch
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    value = getattr(torch, dtype)
    return {"dtype": value} if (major, minor) >= (4, 56) else {"torch_dtype": value}


@contextlib.contextmanager
def _default_dtype(dtype: str) -> Iterator[None]:
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def table_class_name(config: Any) -> str:
    """Accelerate's choice: the first ``AutoModelFor*`` key of ``auto_map``, else ``AutoModel``."""
    auto_map = getattr(config, "auto_map", None)
    if isinstance(auto_map, dict):
        for key in auto_map:
            if key.startswith("AutoModelFor"):
                return key
    return "AutoModel"


def build_table_model(source: ModelSource, trust_remote_code: bool) -> Any:
    """The model Accelerate measures, with Accelerate's tie behaviour, on the meta device."""
    if source.library == "timm":
        return _build_timm(source, fresh_parameter_registration())
    transformers = _import_transformers(source)
    config = load_transformers_config(source, trust_remote_code)
    constructor = getattr(transformers, table_class_name(config))
    return _construct(source, lambda: constructor.from_config(config, trust_remote_code=trust_remote_code, **_dtype_kwargs()),
                      fresh_parameter_registration(), constructor.__name__)


def trained_class(config: Any, model_class: str | None, source: ModelSource) -> tuple[Any, str, bool]:
    """The class that training instantiates: ``model_class``, else the config's ``architectures[0]``.

    Returns (constructor, name, is_auto): Auto classes build with ``from_config``, concrete ones with
    ``_from_config``.
    """
    transformers = _import_transformers(source)
    auto_map = getattr(config, "auto_map", None) or {}
    wanted = model_class or next(iter(getattr(config, "architectures", None) or []), None)
    if wanted is None:
        for auto_name in _HEAD_AUTO_CLASSES:
            auto = getattr(transformers, auto_name)
            if type(config) in auto._model_mapping:
                return auto, auto._model_mapping[type(config)].__name__, True
        return transformers.AutoModel, transformers.AutoModel._model_mapping[type(config)].__name__, True
    if wanted.startswith("Auto") and hasattr(transformers, wanted):
        auto = getattr(transformers, wanted)
        if type(config) in getattr(auto, "_model_mapping", {}):
            return auto, auto._model_mapping[type(config)].__name__, True
        if wanted in auto_map:
            return auto, str(auto_map[wanted]).split(".")[-1], True
        raise EstimateError(
            f"`{wanted}` has no class for the model type `{getattr(config, 'model_type', '?')}` of `{source.name}`. "
            "Pass a concrete class name (for example the one in config.json's `architectures`) to `--model_class`."
        )
    for key, value in auto_map.items():
        if key.startswith("AutoModel") and str(value).split(".")[-1] == wanted:
            return getattr(transformers, key), wanted, True
    constructor = getattr(transformers, wanted, None)
    if constructor is None:
        where = "`--model_class`" if model_class else f"config.json's `architectures` ({source.location})"
        raise EstimateError(
            f"{where} names `{wanted}`, which transformers {transformers.__version__} does not have and the "
            "config's `auto_map` does not provide. Check the spelling, upgrade transformers, or pass "
            "`--model_class` with a class transformers knows (for example `AutoModelForCausalLM`)."
        )
    return constructor, wanted, False


def build_trained_model(source: ModelSource, trust_remote_code: bool, model_class: str | None,
                        dtype: str = "float32", config: Any = None, attn_implementation: str | None = None) -> tuple[Any, str]:
    """The trained class on the meta device, ties intact, weights in ``dtype``; returns (model, class name).

    ``config`` replaces the loaded transformers config (the activation trace builds a shallower copy);
    ``attn_implementation`` (transformers only) asks for ``eager`` or ``sdpa`` attention, None lets
    the config, then transformers, choose.
    """
    import torch

    if source.library == "timm":
        with _default_dtype(dtype):
            model = _build_timm(source, torch.device("meta"))
        return model, type(model).__name__
    config = config if config is not None else load_transformers_config(source, trust_remote_code)
    constructor, name, is_auto = trained_class(config, model_class, source)
    kwargs = _dtype_kwargs(dtype)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if is_auto:
        make = lambda: constructor.from_config(config, trust_remote_code=trust_remote_code, **kwargs)  # noqa: E731
    else:
        make = lambda: constructor._from_config(config, **kwargs)  # noqa: E731
    model = _construct(source, make, torch.device("meta"), name)
    return model, type(model).__name__


def to_fake(model: Any) -> Any:
    """Swap a meta model's tensors for fake CPU tensors (same shapes, dtypes and ties), in place.

    Fake tensors on CPU run the model's real forward (CPU kernels' choices, autocast) without memory.
    Building under FakeTensorMode directly would run weight init, which some models do with `.item()`.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    made: dict[int, Any] = {}

    def fake(tensor: Any, parameter: bool) -> Any:
        if id(tensor) not in made:
            with mode:
                empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            made[id(tensor)] = torch.nn.Parameter(empty, requires_grad=tensor.requires_grad) if parameter else empty
        return made[id(tensor)]

    for module in model.modules():
        for name, tensor in list(module._parameters.items()):
            if tensor is not None:
                module._parameters[name] = fake(tensor, True)
        for name, tensor in list(module._buffers.items()):
            if tensor is not None:
                module._buffers[name] = fake(tensor, False)
    return model


def _construct(source: ModelSource, make: Any, context: Any, class_name: str) -> Any:
    try:
        with context:
            return make()
    except EstimateError:
        raise
    except ValueError as error:
        if "trust_remote_code" in str(error):
            raise EstimateError(
                f"`{source.name}` ships its own modeling code, which runs only with `--trust_remote_code`. "
                "Read that code first, then pass `--trust_remote_code`."
            ) from None
        raise EstimateError(
            f"Building `{class_name}` for `{source.name}` without weights failed: {error}. Check the config "
            f"({source.location}) or choose another class with `--model_class`."
        ) from None
    except Exception as error:  # noqa: BLE001 - the model's own constructor rejects the config in its own way
        # (an assert, an IndexError from a per-layer list too short, ...): the config is the input, so say so
        broken = failed_import(error)
        if broken is not None:  # a library transformers/timm imports on the way is broken: name it, not the class
            raise DependencyError.broken(broken[0], broken[1], f"Sizing `{source.name}`") from None
        raise EstimateError(
            f"Building `{class_name}` for `{source.name}` without weights failed: {type(error).__name__}: "
            f"{str(error).rstrip('.')}. Check the config ({source.location}), install what the message names, or choose another "
            "class with `--model_class`."
        ) from None


# ---------------------------------------------------------------------------------------------- timm


def timm_model_name(source: ModelSource) -> str:
    """What to hand `timm.create_model`: the architecture, or a local folder holding timm's config.json."""
    return source.location if source.kind == "timm" else f"local-dir:{source.location}"


def _build_timm(source: ModelSource, context: Any) -> Any:
    timm = _import_timm(source)
    name = timm_model_name(source)
    try:
        with context:
            return timm.create_model(name, pretrained=False)
    except RuntimeError as error:
        if "Unknown model" in str(error):
            arch = (source.config or {}).get("architecture", source.location)
            raise EstimateError(
                f"timm {timm.__version__} has no architecture `{arch}` (from `{source.name}`, {source.location}). "
                "Check `architecture` in config.json, or upgrade timm."
            ) from None
        raise EstimateError(f"timm could not build `{source.name}` without weights: {error}") from None
    except (ValueError, KeyError, TypeError, OSError) as error:
        raise EstimateError(
            f"timm could not build `{source.name}` from {source.location}: {type(error).__name__}: {error}. "
            "Check the config.json (timm format: `architecture`, `num_classes`, `pretrained_cfg`)."
        ) from None
