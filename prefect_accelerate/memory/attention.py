"""The attention kernel a CUDA device will run, stood in for while the activation trace runs on CPU.

The trace runs the model's real forward on fake CPU tensors, but the attention kernel CPU picks is not
the one a GPU runs, and the kernels keep very different tensors for backward. Which backend CUDA's
`scaled_dot_product_attention` takes is decided by PyTorch's dispatcher, transcribed rule by rule in
memory/sdpa_rules.py and fed here with the fake tensors' real metadata (dtype after autocast, heads,
head dim, strides, the mask's dtype, shape and grad, dropout, `enable_gqa`). What each backend keeps:

- flash (and cuDNN, which keeps the same): q, k, v, the output and a (B, H, L) fp32 logsumexp. A head
  dim that is not a multiple of 8 is padded first (attention.cpp `pad_last_dim<8>`), so the padded
  copies of q, k and v and the padded output are what is saved.
- memory-efficient: q, k, v, the mask, the output and a (B, H, ceil(L/32)*32) fp32 logsumexp. When the
  mask requires grad (T5's learned position bias), backward allocates its gradient at the expanded
  (B, H, L, S) shape, last dimension rounded up to 16 (`_efficient_attention_backward`): a backward
  temporary the size of a seq x seq matrix. Dropout in fused kernels is a Philox seed and offset.
- math: the composite reference: ``softmax(q*sqrt(s) @ (k*sqrt(s))^T + mask)`` then dropout and ``@ v``.
  It keeps the (B, H, L, S) probabilities (and, with dropout, a 1-byte mask and the dropped
  probabilities), upcasting fp16/bf16 inputs to fp32 first.

Eager attention (transformers' own `eager_attention_forward`) keeps its probabilities whatever the device.

Dropout differs too: CUDA runs the fused `native_dropout` kernel, which keeps a 1-byte mask; on CPU
`torch.nn.functional.dropout` decomposes into a multiply by a float noise tensor kept in the input's
dtype (4x the bytes in fp32). The stand-in runs the fused form.

`cuda_kernels()` patches `torch.nn.functional.scaled_dot_product_attention` and `dropout` for the
duration of the trace (transformers looks both up at call time) and records which kernels ran. It also
puts CUDA's autocast policy in place of CPU's (memory/autocast_rules.py): which ops run in fp32 under
mixed precision decides the dtype of much of what backward keeps.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from typing import Any

from prefect_accelerate.memory.sdpa_rules import (
    CUDNN,
    DEFAULT_PRIORITY,
    EFFICIENT,
    EFFICIENT_BIAS_GRAD_ALIGN,
    FLASH,
    MATH,
    CudaTarget,
    MaskInfo,
    SdpaCall,
    padded_head_dim,
    select_sdp_backend,
    torch_release,
)

#: Memory-efficient attention pads its logsumexp's sequence dimension to a multiple of this.
MEM_EFFICIENT_LSE_ALIGN = 32


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def describe_call(q: Any, k: Any, v: Any, attn_mask: Any, dropout_p: float, is_causal: bool, enable_gqa: bool) -> SdpaCall:
    """The dispatcher's view of one SDPA call, read from (fake) tensors."""
    import torch

    mask = None
    if attn_mask is not None:
        mask = MaskInfo(dtype=_dtype_name(attn_mask.dtype), shape=tuple(attn_mask.shape),
                        last_stride=int(attn_mask.stride(-1)) if attn_mask.dim() else 1,
                        requires_grad=bool(attn_mask.requires_grad and torch.is_grad_enabled()))
    return SdpaCall(
        dtype=_dtype_name(q.dtype), batch=int(q.shape[0]) if q.dim() == 4 else 1, q_heads=int(q.shape[-3]),
        kv_heads=int(k.shape[-3]), q_len=int(q.shape[-2]), kv_len=int(k.shape[-2]), head_dim=int(q.shape[-1]),
        value_dim=int(v.shape[-1]), mask=mask, is_causal=bool(is_causal), dropout=float(dropout_p), enable_gqa=bool(enable_gqa),
        requires_grad=bool(torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)),
        last_strides_one=all(int(t.stride(-1)) == 1 for t in (q, k, v)),
        same_dtypes=q.dtype == k.dtype == v.dtype, ndim=q.dim(),
    )


def current_target(capability: tuple[int, int] | None = None) -> CudaTarget:
    """The CUDA target: the given compute capability (else this machine's first GPU, else 9.0), the
    installed torch, and the SDPA backends the user left enabled (torch.backends.cuda)."""
    import torch

    if capability is None:
        capability = torch.cuda.get_device_capability(0) if torch.cuda.is_available() else (9, 0)
    backends = torch.backends.cuda
    enabled = {name for name, on in ((FLASH, backends.flash_sdp_enabled()), (EFFICIENT, backends.mem_efficient_sdp_enabled()),
                                     (CUDNN, getattr(backends, "cudnn_sdp_enabled", lambda: False)()),
                                     (MATH, backends.math_sdp_enabled())) if on}
    names = {0: MATH, 1: FLASH, 2: EFFICIENT, 3: CUDNN}
    try:
        priority = tuple(names[i] for i in torch._C._get_sdp_priority_order() if i in names)
        half_math = bool(torch._C._get_math_sdp_allow_fp16_bf16_reduction())
    except AttributeError:  # older torch: its fixed order
        priority, half_math = DEFAULT_PRIORITY, False
    return CudaTarget(capability=tuple(capability), torch=torch_release(torch.__version__), enabled=frozenset(enabled),
                      priority=priority or DEFAULT_PRIORITY, math_reduces_in_half=half_math)


def cuda_sdpa_kernel(q: Any, k: Any, attn_mask: Any, enable_gqa: bool, force_flash: bool = False, *, v: Any = None,
                     dropout_p: float = 0.0, is_causal: bool = False, target: CudaTarget | None = None) -> str:
    """The backend CUDA's SDPA picks for these inputs: ``flash``, ``efficient``, ``cudnn`` or ``math``."""
    if force_flash:
        return FLASH
    call = describe_call(q, k, v if v is not None else k, attn_mask, dropout_p, is_causal, enable_gqa)
    return select_sdp_backend(call, target or CudaTarget()).backend


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
                    enable_gqa: bool, upcast: bool = True) -> Any:
    """PyTorch's math backend, op for op, with CUDA's fused dropout and its fp32 upcast of 16-bit inputs
    (`_scaled_dot_product_attention_math` in attention.cpp, unless allow_fp16_bf16_reduction_math_sdp)."""
    import torch

    dtype = q.dtype
    if upcast and dtype in (torch.float16, torch.bfloat16):
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
    """The CUDA attention kernels the trace stood in for, in the order first seen, and what they add in backward."""

    def __init__(self, force_flash: bool = False, target: CudaTarget | None = None) -> None:
        self.force_flash = force_flash
        self.target = target or CudaTarget()
        self.kernels: list[str] = []
        self.reasons: dict[str, str] = {}
        #: the largest temporary one attention backward allocates beyond the gradients of q, k and v
        #: (memory-efficient's gradient of a mask that requires grad)
        self.backward_bytes = 0
        self.padded_head_dims: set[tuple[int, int]] = set()
        #: ops CUDA autocasts by a policy we have not transcribed (run in fp32: memory/autocast_rules.py)
        self.unknown_autocast: set[str] = set()

    def note(self, kernel: str, reasons: dict[str, str] | None = None) -> None:
        if kernel not in self.kernels:
            self.kernels.append(kernel)
            if reasons:
                self.reasons[kernel] = "; ".join(f"{name} refused: {why}" for name, why in reasons.items())


#: One trace patches torch at a time; other threads keep torch's own functions meanwhile.
_PATCH_LOCK = threading.Lock()
_TRACING = threading.local()


@contextlib.contextmanager
def cuda_kernels(force_flash: bool = False, capability: tuple[int, int] | None = None) -> Iterator[KernelLog]:
    """Run SDPA and dropout as CUDA would (see the module docstring) while the trace runs in this thread."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    from prefect_accelerate.memory.autocast_rules import cuda_policy

    log = KernelLog(force_flash, current_target(capability))
    with _PATCH_LOCK, cuda_policy() as log.unknown_autocast:
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
            return _stand_in(active, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

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


def _stand_in(log: KernelLog, q: Any, k: Any, v: Any, attn_mask: Any, dropout_p: float, is_causal: bool,
              scale: float | None, enable_gqa: bool) -> Any:
    """One SDPA call as the chosen CUDA backend runs it, keeping what that backend keeps for backward."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    if log.force_flash:
        kernel, reasons = FLASH, {}
    else:
        choice = select_sdp_backend(describe_call(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa), log.target)
        kernel, reasons = choice.backend, choice.refused
    log.note(kernel, reasons)
    if kernel == MATH:
        with torch.autocast("cpu", enabled=False):
            return _math_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                   upcast=not log.target.math_reduces_in_half)
    length = q.shape[-2]
    if kernel == EFFICIENT:
        length = -(-length // MEM_EFFICIENT_LSE_ALIGN) * MEM_EFFICIENT_LSE_ALIGN
        if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
            # _efficient_attention_backward: grad_bias at the mask's expanded (B, H, L, S) shape, S rounded up to 16
            padded = -(-k.shape[-2] // EFFICIENT_BIAS_GRAD_ALIGN) * EFFICIENT_BIAS_GRAD_ALIGN
            size = q.shape[0] * q.shape[-3] * q.shape[-2] * padded * attn_mask.element_size()
            log.backward_bytes = max(log.backward_bytes, int(size))
    head_dim, v_dim = q.shape[-1], v.shape[-1]
    if kernel == FLASH and (head_dim % 8 or v_dim % 8):
        # the composite pads q, k, v to a multiple of 8 (attention.cpp pad_last_dim<8, false>); flash keeps the copies
        log.padded_head_dims.add((head_dim, padded_head_dim(head_dim)))
        q = F.pad(q, (0, padded_head_dim(head_dim) - head_dim))
        k = F.pad(k, (0, padded_head_dim(head_dim) - head_dim))
        v = F.pad(v, (0, padded_head_dim(v_dim) - v_dim))
        return _FusedAttention.get().apply(q, k, v, None, length)[..., :v_dim]
    return _FusedAttention.get().apply(q, k, v, attn_mask if kernel != FLASH else None, length)


def requested_attention(config: Any, override: str | None) -> str | None:
    """The attention implementation asked for: the flag, else the config's own setting, else None."""
    if override:
        return override
    value = getattr(config, "_attn_implementation_internal", None)
    return value if isinstance(value, str) and value else None
