"""The vocabulary of `estimate-memory`, as data: the parser, the models and the formulas all read it.

Pure Python on purpose: `prefect-accelerate --help` imports this module and must stay fast.
"""

from __future__ import annotations

#: Row names of Accelerate's table, in Accelerate's default order (bfloat16 is our addition).
DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16", "int8", "int4")
DEFAULT_DTYPES: tuple[str, ...] = ("float32", "float16", "int8", "int4")

#: How Accelerate scales the float32 sizes for each row (int4 is half of int8).
DTYPE_DIVISOR: dict[str, int] = {"float32": 1, "float16": 2, "bfloat16": 2, "int8": 4, "int4": 8}

LIBRARIES: tuple[str, ...] = ("timm", "transformers")

STRATEGIES: tuple[str, ...] = (
    "ddp",
    "zero1",
    "zero2",
    "zero3",
    "fsdp_full_shard",
    "fsdp_shard_grad_op",
    "fsdp_hybrid_shard",
)
DEEPSPEED_STRATEGIES: tuple[str, ...] = ("zero1", "zero2", "zero3")
FSDP_STRATEGIES: tuple[str, ...] = ("fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_hybrid_shard")

OFFLOADS: tuple[str, ...] = ("none", "optimizer", "optimizer+params")
OPTIMIZERS: tuple[str, ...] = ("adamw", "adam", "sgd", "adafactor", "adamw_8bit")
MIXED_PRECISIONS: tuple[str, ...] = ("no", "fp16", "bf16")
#: transformers' attention implementations `--attn_implementation` can model (memory/attention.py).
ATTN_IMPLEMENTATIONS: tuple[str, ...] = ("eager", "sdpa", "flash_attention_2")

#: Extra share of device memory a user may keep back in a fit verdict (`--reserve`), on top of what the
#: CUDA allocator model adds (memory/fit.py, docs/memory.md "Fit verdict"). None by default: the
#: allocator's needs are modelled, not guessed as a flat share.
DEFAULT_RESERVE_FRACTION = 0.0

#: Named in an estimate's attention detail when the trace met ops CUDA autocasts by a policy this package has not
#: transcribed (memory/autocast_rules.py); memory/fit.py reads it as an unmodelled path.
UNKNOWN_AUTOCAST = "CUDA autocast policy not transcribed for"


def weight_dtype(precision_mode: str) -> str:
    """The dtype the weights have during forward: float32, or the 16-bit type of bf16*/fp16* modes."""
    return {"bf16": "bfloat16", "fp16": "float16"}.get(precision_mode.split("+")[0], "float32")
