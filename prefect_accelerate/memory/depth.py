"""Deep stacks traced shallow, with every kind of block the stack has.

Tracing all 80 blocks of a 70B-shaped model costs seconds; its blocks are copies of one another, so a
trace of a few stands for the rest. Not every stack is one block repeated: hybrid and mixture-of-experts
configs build different blocks at different depths from rules of their own (a dense MLP for the first
k blocks, an attention block every 8th among Mamba blocks, experts every other block, a per-block list
of attention kinds). A shallow copy that keeps only the first two blocks would trace none of the others
and count the rest of the stack like block 1 (a 2-of-8 trace of a Bamba model with one attention block
came out 13% over; of a Qwen2-MoE model with experts every third block, 9% under).

So the kinds are read from the model transformers builds, not from the config's field names (each
family spells its rule differently): a block's kind is its module tree (classes and parameter shapes),
the plain values its modules hold (an attention block's ``sliding_window``, ``is_causal``), and its entry
in every per-block list of the config. Values that differ in every block (``layer_idx``) are its
position, not its kind. The shallow copy keeps the shortest prefix of the stack that holds every kind
after its first block (at least `SHALLOW_BLOCKS`: block 0 also does what the stack does once); each further
block is counted like the last traced block of its kind. The
shallow model is checked to have built exactly that prefix and, in the trace, to call each block once in
order; where it did not (a config whose rule reads its depth, a stack that loops over part of itself), the
stack is traced in full.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable
from typing import Any, NamedTuple

#: blocks kept at least when tracing a deep stack shallow; stacks of fewer than `SHALLOW_FROM` are traced in full
SHALLOW_BLOCKS = 2
SHALLOW_FROM = 8
_PLAIN = (bool, int, float, str, type(None))


class NotOneCallPerBlock(Exception):
    """The shallow model did not call each of its blocks once, in order (a stack that loops over some of its blocks
    by a rule that reads the depth): its trace cannot stand for the real stack, which is then traced in full."""


class ShallowPlan(NamedTuple):
    """A shallower copy of the config, and for every block of the real stack the traced block it repeats."""

    config: Any
    layout: list[int]
    kinds: list[Hashable]  # of the traced blocks, to check the shallow model against
    positional: frozenset[str]
    lists: tuple[str, ...]  # the config's per-block lists, now as long as the traced stack


def checkpoint_layers(model: Any) -> list[Any]:
    """The blocks activation checkpointing wraps: transformers' GradientCheckpointingLayer, else no-split blocks."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        GradientCheckpointingLayer = None  # noqa: N806
    names = set(getattr(model, "_no_split_modules", None) or ())
    if GradientCheckpointingLayer is not None:
        return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    return [m for m in model.modules() if type(m).__name__ in names]


def _per_block_lists(config: Any, depth: int) -> dict[str, Any]:
    return {name: value for name, value in vars(config).items() if isinstance(value, (list, tuple)) and len(value) == depth}


def _values(block: Any) -> dict[str, Any]:
    """Every plain value the block's modules hold, by module path and attribute."""
    found = {}
    for path, module in block.named_modules():
        for name, value in vars(module).items():
            if not name.startswith("_") and name != "training" and isinstance(value, _PLAIN):
                found[f"{path}.{name}"] = value
    return found


def _structure(block: Any) -> tuple:
    return tuple(
        (path, type(module).__qualname__,
         tuple((name, tuple(p.shape), p.requires_grad) for name, p in module.named_parameters(recurse=False)),
         tuple((name, tuple(b.shape)) for name, b in module.named_buffers(recurse=False)))
        for path, module in block.named_modules()
    )


def block_kinds(blocks: list[Any], lists: dict[str, Any], positional: frozenset[str] | None = None
                ) -> tuple[list[Hashable], frozenset[str]]:
    """The kind of each block, and the names of the values that only say where a block sits.

    Args:
        blocks: the stack's blocks, in order.
        lists: the config's per-block lists (name -> one entry per block).
        positional: the value names to leave out; None finds them: those that differ in every block.
    """
    values = [_values(block) for block in blocks]
    if positional is None:
        names = set().union(*values) if values else set()
        positional = frozenset(
            {name for name in names if len({repr(v.get(name)) for v in values}) == len(blocks) > 1}
            # a list with a different entry for every block numbers them (Llama 4's `moe_layers` when every
            # block has experts): what differs between the blocks it names shows in their modules
            | {name for name, entry in lists.items() if len({repr(e) for e in entry}) == len(blocks) > 1})
    kinds = []
    for i, block in enumerate(blocks):
        own = tuple(sorted((name, repr(value)) for name, value in values[i].items() if name not in positional))
        entries = tuple((name, repr(entry[i])) for name, entry in sorted(lists.items()) if name not in positional)
        kinds.append((_structure(block), own, entries))
    return kinds, positional


def shallow_plan(config: Any, model: Any) -> ShallowPlan | None:
    """How to trace ``model`` (built from ``config``) with fewer blocks; None when it must be traced as it is.

    Traced as it is: stacks shorter than `SHALLOW_FROM`, encoder-decoder models (two stacks), models whose
    number of blocks is not the config's depth (HRM loops its stacks), configs that refuse a new depth, and
    stacks whose kinds only all appear near the end.
    """
    depth = getattr(config, "num_hidden_layers", None)
    if not isinstance(depth, int) or depth < SHALLOW_FROM or getattr(config, "is_encoder_decoder", False):
        return None
    blocks = checkpoint_layers(model)
    if len(blocks) != depth:
        return None
    lists = _per_block_lists(config, depth)
    kinds, positional = block_kinds(blocks, lists)
    # the first block stands for no other: it takes the embeddings' output and makes what the stack makes once
    # (a mask, a cache entry), so every kind that comes again after the prefix is traced past block 0 as well
    keep = SHALLOW_BLOCKS
    while not set(kinds[keep:]) <= set(kinds[1:keep]):
        keep += 1
    if keep >= depth:
        return None
    shallow = copy.deepcopy(config)
    try:
        for name in lists:
            setattr(shallow, name, getattr(shallow, name)[:keep])
        shallow.num_hidden_layers = keep
    except Exception:  # noqa: BLE001 - any config that refuses a new depth (ProphetNet's setter raises
        # NotImplementedError) is traced at its own depth
        return None
    last_of = {kind: i for i, kind in enumerate(kinds[:keep])}
    layout = [i if i < keep else last_of[kind] for i, kind in enumerate(kinds)]
    return ShallowPlan(shallow, layout, kinds[:keep], positional, tuple(lists))


def builds_the_prefix(plan: ShallowPlan, model: Any) -> bool:
    """Whether the shallow model has exactly the traced prefix of the real stack, block for block."""
    blocks = checkpoint_layers(model)
    if len(blocks) != len(plan.kinds):
        return False
    kinds, _ = block_kinds(blocks, {name: getattr(plan.config, name) for name in plan.lists}, plan.positional)
    return kinds == plan.kinds
