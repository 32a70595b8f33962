"""Keep optional libraries that a text model never uses out of a cold `estimate-memory`.

transformers 5.x imports vision and detection helpers on every model's path: a Llama config module
imports ``utils.type_validators``, which imports ``video_utils`` -> ``image_transforms`` ->
``image_utils``, which imports ``torchvision.transforms`` whenever transformers' availability check
(``importlib.util.find_spec``) finds torchvision; ``modeling_utils`` imports ``loss_for_object_detection``,
which imports ``scipy.optimize`` for the Hungarian matcher; transformers' Accelerate integration reaches
``accelerate.commands.config.sagemaker``, which imports boto3. None of it runs when a text model is built
and traced, but importing torchvision costs ~0.3-1.7 s here (its ``ops`` import ``torch._dynamo``, its
``models`` and ``datasets`` packages load eagerly) and a torchvision built for another torch stops
the estimate altogether.

Python's own switch does the job: a ``None`` in ``sys.modules`` makes ``import`` raise
ImportError and ``importlib.util.find_spec`` answer None, which is exactly what transformers asks
before it imports these libraries; transformers then takes the branch it takes on a machine without
them. Nothing of transformers is patched.

When: only for a transformers model whose config has no sub-model configs (a composite such as
LLaVA builds other models' code) and whose own modeling module (``transformers/models/<type>/
modeling_<type>.py``) names none of these libraries; a model whose code names one (DETR's family
imports torchvision's ops) keeps them all. Timm models always keep torchvision (timm imports it).

transformers caches what it found, so for the rest of the process its image helpers stay without
the hidden library: `hidden_for` is therefore used only by a command that owns its process and before
transformers was imported (`estimate-memory` from the command line), never by the library API.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: Optional libraries imported on the way for code a text model never runs: transformers' image/video helpers
#: (torchvision), its detection losses (scipy), Accelerate's SageMaker config (boto3, via transformers'
#: accelerate integration).
OPTIONAL_LIBRARIES: tuple[str, ...] = ("torchvision", "scipy", "boto3")


def _modeling_source(model_type: str) -> str | None:
    """The text of transformers' modeling module for ``model_type``, found without importing transformers."""
    loaded = sys.modules.get("transformers")
    if loaded is not None:
        roots = list(getattr(loaded, "__path__", []))
    else:
        spec = importlib.util.find_spec("transformers")
        roots = list(spec.submodule_search_locations or []) if spec is not None else []
    module = model_type.replace("-", "_")
    for root in roots:
        path = Path(root) / "models" / module / f"modeling_{module}.py"
        if path.is_file():
            return path.read_text(encoding="utf-8", errors="replace")
    return None


def unused_libraries(library: str, config: dict[str, Any] | None) -> tuple[str, ...]:
    """The optional libraries that building and tracing this model never uses (see the module's rule)."""
    if library != "transformers" or not isinstance(config, dict) or config.get("auto_map"):
        return ()
    if any(key.endswith("_config") and isinstance(value, dict) for key, value in config.items()):
        return ()  # a composite model: its sub-models' code is not read here
    model_type = config.get("model_type")
    source = _modeling_source(model_type) if isinstance(model_type, str) and model_type else None
    if source is None:
        return ()
    if any(name in source for name in OPTIONAL_LIBRARIES):
        return ()  # vision/detection code (DETR's family): its losses may reach the others too; keep them all
    return OPTIONAL_LIBRARIES


@contextlib.contextmanager
def hidden(names: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    """Make ``names`` look absent (``sys.modules[name] = None``) for the block; libraries already imported stay.

    Yields the names really hidden. On exit the entries go, so a later import in this process works.
    """
    hid = tuple(name for name in names if name not in sys.modules)
    for name in hid:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield hid
    finally:
        for name in hid:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def hidden_for(library: str, config: dict[str, Any] | None) -> contextlib.AbstractContextManager[tuple[str, ...]]:
    """`hidden` for this model's unused libraries, only while transformers is not yet imported in this process."""
    if "transformers" in sys.modules:
        return contextlib.nullcontext(())
    return hidden(unused_libraries(library, config))
