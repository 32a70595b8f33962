"""The attention kernel a CUDA device will run, stood in for while the activation trace runs on CPU.

The trace runs the model's real forward on fake CPU tensors, but the attention kernel CPU picks is not
the one a GPU runs, and the two keep very different tensors for backward. On CUDA, PyTorch's
`scaled_dot_product_attention` takes the first backend whose constraints the call meets, in this order:

- flash attention: fp16/bf16 only, no `attn_mask`, head dimension a multiple of 8 up to 256, grouped
  (GQA) keys and values allowed. Keeps q, k, v, the output and a (B, H, L) fp32 logsumexp.
- memory-efficient attention: fp32 too, takes an `attn_mask`, but not grouped keys/values (the key and
  value heads must equal the query heads). Keeps q, k, v, the mask, the output and a (B, H, ceil(L/32)*32)
  fp32 logsumexp. Dropout in either fused kernel is a Philox seed and offset, not a mask.
- math: the composite reference: ``softmax(q*sqrt(s) @ (k*sqrt(s))^T + mask)`` then dropout and ``@ v``.
  It keeps the (B, H, L, S) probabilities (and, with dropout, a 1-byte mask and the dropped
  probabilities), upcasting fp16/bf16 inputs to fp32 first.

So an fp32 model with grouped keys and values (Llama-style GQA) falls back to math and keeps a seq x seq
matrix per layer, where the same model in bf16 keeps none. Eager attention (transformers' own
`eager_attention_forward`) keeps its probabilities whatever the device.

Dropout differs too: CUDA runs the fused `native_dropout` kernel, which keeps a 1-byte mask; on CPU
`torch.nn.functional.dropout` decomposes into a multiply by a float noise tensor kept in the input's
dtype (4x the bytes in fp32). The stand-in runs the fused form.

`cuda_kernels()` patches `torch.nn.functional.scaled_dot_product_attention` and `dropout` for the
duration of the trace (transformers looks both up at call time) and records which kernels ran.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from typing import Any

#: Memory-efficient attention pads its logsumexp's sequence dimension to a multiple of this.
MEM_EFFICIENT_LSE_ALIGN = 32
FLASH_MAX_HEAD_DIM = 256


def cuda_sdpa_kernel(q: Any, k: Any, attn_mask: Any, enable_gqa: bool, force_flash: bool = False) -> str:
    """The backend CUDA's SDPA picks for these inputs: ``flash``, ``efficient`` or ``math``."""
    import torch

    half = q.dtype in (torch.float16, torch.bfloat16)
    head_dim = q.shape[-1]
    grouped = q.shape[-3] != k.shape[-3]
    if force_flash:
        return "flash"
    if grouped and not enable_gqa:
        return "math"  # SDPA itself refuses mismatched heads without enable_gqa; math reports the error
    if half and attn_mask is None and head_dim % 8 == 0 and head_dim <= FLASH_MAX_HEAD_DIM:
        return "flash"
    if not grouped and head_dim % (8 if half else 4) == 0:
        return "efficient"
    return "math"


class _FusedAttention:
    """An autograd function keeping what the fused CUDA kernels keep for backward (built lazily: torch import)."""

    function: Any = None

    @classmethod
    def get(cls) -> Any:
        if cls.function is None:
            import torch

            class FusedAttention(torch.autograd.Function):
                @staticmethod
                def forward(ctx, q, k, v, mask, lse_len):  # noqa: ANN001, ANN205
                    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
                    lse = q.new_empty((*q.shape[:-2], lse_len), dtype=torch.float32)
                    kept = (q, k, v, out, lse) if mask is None else (q, k, v, out, lse, mask)
                    ctx.save_for_backward(*kept)
                    ctx.has_mask = mask is not None
                    return out

                @staticmethod
                def backward(ctx, grad):  # noqa: ANN001, ANN205 - never run: the trace has no backward
                    q, k, v = ctx.saved_tensors[:3]
                    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None

            cls.function = FusedAttention
        return cls.function


def _math_attention(q: Any, k: Any, v: Any, attn_mask: Any, dropout_p: float, is_causal: bool, scale: float | None,
                    enable_gqa: bool) -> Any:
    """PyTorch's math backend, op for op, with CUDA's fused dropout and its fp32 upcast of 16-bit inputs."""
    import torch

    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    factor = math.sqrt(scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if is_causal:
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~attn_mask, float("-inf"))
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        repeat = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
    attn = (q * factor) @ (k.transpose(-2, -1) * factor)
    if attn_mask is not None:
        attn = attn + attn_mask.to(attn.dtype)
    attn = torch.softmax(attn, dim=-1)
    if dropout_p > 0:
        attn = torch.native_dropout(attn, dropout_p, True)[0]
    return (attn @ v).to(dtype)


class KernelLog:
    """The CUDA attention kernels the trace stood in for, in the order first seen."""

    def __init__(self, force_flash: bool = False) -> None:
        self.force_flash = force_flash
        self.kernels: list[str] = []

    def note(self, kernel: str) -> None:
        if kernel not in self.kernels:
            self.kernels.append(kernel)


#: One trace patches torch at a time; other threads keep torch's own functions meanwhile.
_PATCH_LOCK = threading.Lock()
_TRACING = threading.local()


@contextlib.contextmanager
def cuda_kernels(force_flash: bool = False) -> Iterator[KernelLog]:
    """Run SDPA and dropout as CUDA would (see the module docstring) while the trace runs in this thread."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    log = KernelLog(force_flash)
    with _PATCH_LOCK:
        original_sdpa, original_dropout = F.scaled_dot_product_attention, F.dropout

        def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # noqa: ANN001, ANN202
            active = getattr(_TRACING, "log", None)
            if active is None:  # another thread, not tracing: torch's own
                return original_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                     scale=scale, enable_gqa=enable_gqa)
            if torch.is_autocast_enabled("cpu"):  # CUDA autocast runs SDPA in the lower precision
                low = torch.get_autocast_dtype("cpu")
                query, key, value = (t.to(low) if t.is_floating_point() else t for t in (query, key, value))
                if attn_mask is not None and attn_mask.is_floating_point():
                    attn_mask = attn_mask.to(low)
            kernel = cuda_sdpa_kernel(query, key, attn_mask, enable_gqa, active.force_flash)
            active.note(kernel)
            if kernel == "math":
                with torch.autocast("cpu", enabled=False):
                    return _math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
            length = query.shape[-2]
            if kernel == "efficient":
                length = -(-length // MEM_EFFICIENT_LSE_ALIGN) * MEM_EFFICIENT_LSE_ALIGN
            return _FusedAttention.get().apply(query, key, value, attn_mask, length)

        def dropout(input, p=0.5, training=True, inplace=False):  # noqa: A002, ANN001, ANN202
            if getattr(_TRACING, "log", None) is None or not training or p in (0, 1):
                return original_dropout(input, p, training, inplace)
            return torch.native_dropout(input, p, True)[0]

        F.scaled_dot_product_attention, F.dropout = sdpa, dropout
        _TRACING.log = log
        try:
            yield log
        finally:
            _TRACING.log = None
            F.scaled_dot_product_attention, F.dropout = original_sdpa, original_dropout


def requested_attention(config: Any, override: str | None) -> str | None:
    """The attention implementation asked for: the flag, else the config's own setting, else None."""
    if override:
        return override
    value = getattr(config, "_attn_implementation_internal", None)
    return value if isinstance(value, str) and value else None
