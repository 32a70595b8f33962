"""Sizes measured on a model without weights: Accelerate's table figures and the trained model's profile.

The table side reproduces Accelerate's `calculate_maximum_sizes` semantics (our own code, same facts,
reference §5.4): every parameter and buffer (non-persistent ones too) is added into each of its name
prefixes, and the largest layer is found by walking down from the top-level parameters, children and
buffers until a leaf or a module whose class is in ``model._no_split_modules``.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from typing import Any

from prefect_accelerate.memory.models import ModelProfile

#: bitsandbytes keeps tensors smaller than this in 32-bit state (its `min_8bit_size`).
BNB_MIN_8BIT_SIZE = 4096


def tensor_bytes(tensor: Any) -> float:
    """Bytes per element as Accelerate counts them: bool is 1/8 of a byte, everything else its itemsize."""
    import torch

    if tensor.dtype == torch.bool:
        return tensor.numel() * (1 / 8)
    return tensor.numel() * tensor.dtype.itemsize


def prefix_sizes(model: Any) -> dict[str, float]:
    """Size of every name prefix ('' is the whole model), parameters and buffers, duplicates once by identity."""
    sizes: dict[str, float] = defaultdict(int)
    for named in (model.named_parameters(), model.named_buffers()):
        for name, tensor in named:
            size = tensor_bytes(tensor)
            parts = name.split(".")
            for end in range(len(parts) + 1):
                sizes[".".join(parts[:end])] += size
    return sizes


def largest_layer(model: Any, sizes: dict[str, float]) -> tuple[float, list[str]]:
    """Accelerate's largest layer: (bytes, names of every layer of that size)."""
    import torch

    keep_whole = set(getattr(model, "_no_split_modules", None) or [])
    todo: deque[tuple[str, Any]] = deque()
    todo.extend(model.named_parameters(recurse=False))
    todo.extend(model.named_children())
    todo.extend(model.named_buffers(recurse=False))
    best: float = 0
    names: list[str] = []
    while todo:
        name, item = todo.popleft()
        children = list(item.named_children()) if isinstance(item, torch.nn.Module) else []
        if children and type(item).__name__ not in keep_whole:
            todo.extendleft(reversed([(f"{name}.{child}", module) for child, module in children]))
            continue
        size = sizes.get(name, 0)
        if size > best:
            best, names = size, [name]
        elif size == best:
            names.append(name)
    return best, names


def table_sizes(model: Any) -> tuple[float, float, list[str]]:
    """(total bytes, largest layer bytes, largest layer names) for the table model."""
    sizes = prefix_sizes(model)
    largest, names = largest_layer(model, sizes)
    return sizes[""], largest, names


def model_profile(model: Any, class_name: str) -> ModelProfile:
    """Count what training needs to know about the trained model (ties once, by identity)."""
    params = list(model.parameters())  # unique by identity: tied weights appear once
    trainable = [p for p in params if p.requires_grad]
    adafactor = 0
    for p in trainable:
        if p.dim() >= 2:
            adafactor += math.prod(p.shape[:-1]) + math.prod(p.shape[:-2]) * p.shape[-1]
        else:
            adafactor += p.numel()
    largest_module = 0
    for module in model.modules():
        largest_module = max(largest_module, sum(p.numel() for p in module.parameters(recurse=False)))

    # transformers gathers _no_split_modules into a set: sorted, so one model gives one profile
    unit_names = sorted(set(getattr(model, "_no_split_modules", None) or []))
    units = _outermost_units(model, set(unit_names))
    inside: set[int] = set()
    largest_unit = 0
    for unit in units:
        unit_params = list(unit.parameters())
        largest_unit = max(largest_unit, sum(p.numel() for p in unit_params))
        inside.update(id(p) for p in unit_params)
    total = sum(p.numel() for p in params)
    root = sum(p.numel() for p in params if id(p) not in inside)
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None)
    return ModelProfile(
        trained_class=class_name,
        parameters=total,
        trainable_parameters=sum(p.numel() for p in trainable),
        buffer_bytes=int(sum(b.numel() * b.element_size() for b in model.buffers())),
        largest_tensor_numel=max((p.numel() for p in params), default=0),
        small_tensor_numel=sum(p.numel() for p in trainable if p.numel() < BNB_MIN_8BIT_SIZE),
        adafactor_state_numel=adafactor,
        largest_module_parameters=largest_module,
        layer_class_names=unit_names,
        layer_count=len(units),
        largest_unit_parameters=largest_unit,
        root_unit_parameters=root,
        hidden_size=hidden if isinstance(hidden, int) else None,
    )


def _outermost_units(model: Any, names: set[str]) -> list[Any]:
    if not names:
        return []
    units: list[Any] = []
    todo = deque(model.children())
    while todo:
        module = todo.popleft()
        if type(module).__name__ in names:
            units.append(module)
        else:
            todo.extend(module.children())
    return units
