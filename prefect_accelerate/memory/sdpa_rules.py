"""Which kernel CUDA's `scaled_dot_product_attention` runs, transcribed from PyTorch's own dispatcher.

PyTorch picks the backend at run time (``sdp::select_sdp_backend`` in
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp): it walks a priority order and takes the first
backend whose every constraint ("filter") holds; math always runs when nothing else does. Each filter
below is one of those constraint functions, named after it, with the file it lives in. The rules were
read from the PyTorch source of the main branch (sdp_utils.cpp at commit 001f694a, sdp_utils_cpp.h at
commit 0119c205) and checked against the H200 measurements in tests/data (torch 2.11); where a rule
changed between releases the version gate says so, and where we could not date a change we keep the
older behaviour, which is the one that keeps more memory (the safe direction for a fit verdict).

Pure Python and no torch import: the activation trace feeds it the metadata of fake tensors
(memory/attention.py), and the tests call it directly, one test per rule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

FLASH, EFFICIENT, CUDNN, MATH = "flash", "efficient", "cudnn", "math"

#: check_head_dim_size_flash (sdp_utils.cpp): q, k and v head dims equal and at most this.
FLASH_MAX_HEAD_DIM = 256
#: The composite SDPA pads q, k and v to a multiple of this before calling flash (attention.cpp,
#: `pad_last_dim<8, false>` in scaled_dot_product_attention; added with FlashAttention-2, pytorch#105602,
#: torch 2.2, so every release we support has it). The padded copies are what flash saves for backward.
FLASH_HEAD_DIM_PAD = 8
#: Memory-efficient backward allocates a bias gradient whose last dimension is rounded up to this
#: (`_efficient_attention_backward`, attention_backward.cu: `alignTo = 16`).
EFFICIENT_BIAS_GRAD_ALIGN = 16
#: check_cudnn_tensor_shapes (sdp_utils.cpp): batch and heads at most this.
CUDNN_MAX_DIM = 65535
#: First torch release whose memory-efficient kernel takes grouped keys/values (`enable_gqa`):
#: `check_batch_size_and_num_heads_dense<supports_gqa=true, ...>` in can_use_mem_efficient_attention of
#: the main-branch source (pytorch#191085). torch 2.11 did not (its fp32 Llama GQA run on the H200 took the
#: math path, tests/data/memory_gpu_h200.json). We could not date the release, so we gate it past the
#: newest release we know of: until then GQA in fp32 is modelled as math, which keeps more memory.
EFFICIENT_GQA_SINCE = (2, 14)
#: Older releases (before 2.5) had no `enable_gqa` at all; transformers then repeats k/v itself.
ENABLE_GQA_SINCE = (2, 5)


@dataclass(frozen=True)
class MaskInfo:
    """What the dispatcher looks at in an ``attn_mask``: its dtype, shape, last stride and grad."""

    dtype: str  # "bool", "float32", "bfloat16", "float16"
    shape: tuple[int, ...]
    last_stride: int = 1
    requires_grad: bool = False


@dataclass(frozen=True)
class SdpaCall:
    """The metadata of one ``scaled_dot_product_attention`` call (4-D dense inputs)."""

    dtype: str  # of q, k and v (after autocast)
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    value_dim: int | None = None
    mask: MaskInfo | None = None
    is_causal: bool = False
    dropout: float = 0.0
    enable_gqa: bool = False
    requires_grad: bool = True  # input_requires_grad: q, k or v requires grad and grad mode is on
    last_strides_one: bool = True  # q, k, v last-dimension stride 1
    same_dtypes: bool = True  # q, k and v share one dtype
    ndim: int = 4

    @property
    def v_dim(self) -> int:
        return self.value_dim if self.value_dim is not None else self.head_dim


@dataclass(frozen=True)
class CudaTarget:
    """The device and software the kernels are chosen for.

    ``capability``: the GPU's compute capability (H100/H200: 9.0, A100: 8.0, L4: 8.9, V100: 7.0).
    ``torch``: the torch release that will run (major, minor). ``enabled``: the backends the user
    left on (`torch.backends.cuda.enable_*_sdp`, `torch.nn.attention.sdpa_kernel`).
    ``prefer_cudnn``: cuDNN first in the priority order (check_prefer_cudnn_attention: sm90/sm100 with a
    cuDNN runtime newer than 9.15, which only the GPU can tell; off by default, and memory-wise cuDNN
    keeps what flash keeps). ``priority``: the context's order otherwise (`torch._C._get_sdp_priority_order`).
    """

    capability: tuple[int, int] = (9, 0)
    torch: tuple[int, int] = (2, 11)
    enabled: frozenset[str] = field(default_factory=lambda: frozenset({FLASH, EFFICIENT, CUDNN, MATH}))
    prefer_cudnn: bool = False
    priority: tuple[str, ...] = (FLASH, EFFICIENT, MATH, CUDNN)
    #: torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp: math keeps 16-bit inputs as they are
    math_reduces_in_half: bool = False


def torch_release(version: str) -> tuple[int, int]:
    """``"2.13.0+cpu"`` -> (2, 13)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def _half(dtype: str) -> bool:
    return dtype in ("float16", "bfloat16")


# ------------------------------------------------------------------------------------------------ filters
# Each returns None when the constraint holds, else the reason (PyTorch's own debug message, in brief).


def check_runtime_disabled(backend: str):  # noqa: ANN201
    """check_runtime_disabled_flash / _mem_efficient (sdp_utils_cpp.h), check_runtime_disabled_cudnn (sdp_utils.cpp)."""
    def check(call: SdpaCall, target: CudaTarget) -> str | None:
        return None if backend in target.enabled else f"{backend} attention is disabled at run time"
    check.__name__ = f"check_runtime_disabled_{backend}"
    return check


def check_tensor_shapes(call: SdpaCall, target: CudaTarget) -> str | None:
    """check_tensor_shapes (sdp_utils_cpp.h): every fused kernel needs 4-D q, k, v."""
    return None if call.ndim == 4 else "fused kernels need 4-dimensional query, key and value"


def check_for_attn_mask(call: SdpaCall, target: CudaTarget) -> str | None:
    """check_for_attn_mask (sdp_utils_cpp.h): flash takes no ``attn_mask`` at all (causal only via is_causal)."""
    return None if call.mask is None else "flash attention takes no attn_mask"


def check_head_dim_size_flash(call: SdpaCall, target: CudaTarget) -> str | None:
    """check_head_dim_size_flash (sdp_utils.cpp): q, k, v head dims equal and <= 256; no multiple-of-8
    rule here, because the composite pads to a multiple of 8 before flash runs (see FLASH_HEAD_DIM_PAD)."""
    if call.head_dim == call.v_dim and call.head_dim <= FLASH_MAX_HEAD_DIM:
        return None
    return f"flash needs equal q/k/v head dims <= {FLASH_MAX_HEAD_DIM} (got {call.head_dim}/{call.v_dim})"


def check_flash_attention_hardware_support(call: SdpaCall, target: CudaTarget) -> str | None:
    """check_flash_attention_hardware_support (sdp_utils.cpp): compute capability sm80 to sm121."""
    return None if (8, 0) <= target.capability <= (12, 1) else f"flash needs sm80..sm121 (device is sm{_sm(target)})"


def check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120(call: SdpaCall, target: CudaTarget) -> str | None:
    """Same name (sdp_utils.cpp): training on sm86-89 or sm120-121 only with head dim <= 192, or > 224 without dropout."""
    consumer = (8, 6) <= target.capability <= (8, 9) or (12, 0) <= target.capability <= (12, 1)
    if not (call.requires_grad and consumer):
        return None
    if call.head_dim <= 192 or (call.dropout == 0 and call.head_dim > 224):
        return None
    return f"flash backward on sm{_sm(target)} does not take head dim {call.head_dim}"


def check_flash_causal_non_square_seqlens(call: SdpaCall, target: CudaTarget) -> str | None:
    """Same name (sdp_utils.cpp): is_causal with different query and key lengths is not flash."""
    return None if not call.is_causal or call.q_len == call.kv_len else "flash takes is_causal only with q_len == kv_len"


def check_dtypes_flash_attention(call: SdpaCall, target: CudaTarget) -> str | None:
    """check_dtypes_flash_attention -> check_dtypes_low_precision (sdp_utils.cpp): fp16/bf16 on sm80+, fp16 below."""
    allowed = ("float16", "bfloat16") if target.capability >= (8, 0) else ("float16",)
    return None if call.same_dtypes and call.dtype in allowed else f"flash takes {'/'.join(allowed)} only (got {call.dtype})"


def check_batch_size_and_num_heads_dense(supports_gqa: bool):  # noqa: ANN201
    """check_batch_size_and_num_heads_dense<supports_gqa> (sdp_utils_cpp.h): equal heads, or with enable_gqa and a
    backend that supports it, kv heads dividing q heads (check_grouped_query_attention)."""
    def check(call: SdpaCall, target: CudaTarget) -> str | None:
        if call.q_heads == call.kv_heads:
            return None
        if call.enable_gqa and supports_gqa and call.q_heads % call.kv_heads == 0:
            return None
        return f"{call.q_heads} query heads and {call.kv_heads} key/value heads{'' if supports_gqa else ' (no GQA in this kernel)'}"
    check.__name__ = "check_batch_size_and_num_heads_dense"
    return check


def check_nonzero_sequence_lengths_dense(call: SdpaCall, target: CudaTarget) -> str | None:
    """Same name (sdp_utils_cpp.h): no fused kernel takes a zero-length sequence."""
    return None if call.q_len > 0 and call.kv_len > 0 else "zero sequence length"


def check_last_dim_stride_equals_1_dense(ignore_singleton_dim: bool):  # noqa: ANN201
    """Same name (sdp_utils_cpp.h): q, k, v and the mask need last-dimension stride 1 (flash and cuDNN
    ignore it for a head dim of 1). A mask built by permuting (T5's position bias before transformers
    made it contiguous) fails this and sends memory-efficient attention to math."""
    def check(call: SdpaCall, target: CudaTarget) -> str | None:
        qkv = call.last_strides_one or (ignore_singleton_dim and call.head_dim == 1)
        mask = call.mask is None or call.mask.last_stride == 1
        return None if qkv and mask else "inputs (or the mask) have a last-dimension stride other than 1"
    check.__name__ = "check_last_dim_stride_equals_1_dense"
    return check


def check_mem_efficient_hardware_support(call: SdpaCall, target: CudaTarget) -> str | None:
    """Same name (sdp_utils.cpp): compute capability sm50 to sm121."""
    return None if (5, 0) <= target.capability <= (12, 1) else f"memory-efficient needs sm50..sm121 (device is sm{_sm(target)})"


def minimum_gemm_alignment(call: SdpaCall, target: CudaTarget) -> int:
    """minimum_gemm_alignment (sdp_utils.cpp): 4 on sm80+, raised to 128 bits / element size with tensor cores
    (sm80+ always, sm70+ for 16-bit): 8 for fp16/bf16 and 4 for fp32 on sm80+."""
    half = _half(call.dtype)
    tensor_cores = target.capability >= (8, 0) or (target.capability >= (7, 0) and half)
    alignment = 4 if target.capability >= (8, 0) else 1
    if tensor_cores:
        alignment = max(alignment, 128 // (16 if half else 32))
    return alignment


def check_head_dim_size_mem_efficient(call: SdpaCall, target: CudaTarget) -> str | None:
    """Same name (sdp_utils.cpp): q and k head dims equal, q and v head dims multiples of minimum_gemm_alignment.
    No padding here: a bf16 head dim of 100 is not memory-efficient (flash takes it, padded)."""
    align = minimum_gemm_alignment(call, target)
    if call.head_dim % align == 0 and call.v_dim % align == 0 and call.head_dim > 0:
        return None
    return f"memory-efficient needs head dims divisible by {align} (got {call.head_dim})"


def check_dtypes_mem_efficient(call: SdpaCall, target: CudaTarget) -> str | None:
    """can_use_mem_efficient_attention's dtype check (sdp_utils.cpp): fp16/fp32/bf16 on sm80+, fp16/fp32 below."""
    allowed = ("float16", "float32", "bfloat16") if target.capability >= (8, 0) else ("float16", "float32")
    return None if call.same_dtypes and call.dtype in allowed else f"memory-efficient takes {'/'.join(allowed)} (got {call.dtype})"


def check_cudnn_hardware_support(call: SdpaCall, target: CudaTarget) -> str | None:
    """Same name (sdp_utils.cpp): sm80 to sm121."""
    return None if (8, 0) <= target.capability <= (12, 1) else f"cuDNN attention needs sm80..sm121 (device is sm{_sm(target)})"


def check_attn_mask_shape(call: SdpaCall, target: CudaTarget) -> str | None:
    """Same name (sdp_utils_cpp.h), used by cuDNN: a mask that requires grad is refused; otherwise 2-D or
    4-D with broadcastable batch and heads."""
    mask = call.mask
    if mask is None:
        return None
    if mask.requires_grad:
        return "cuDNN attention takes no attn_mask that requires grad"
    shape = mask.shape
    if shape[-2] not in (call.q_len, 1) or shape[-1] not in (call.kv_len, 1):
        return "attn_mask shape does not broadcast to (q_len, kv_len)"
    if len(shape) == 2 or (len(shape) == 4 and shape[0] in (1, call.batch) and shape[1] in (1, call.q_heads)):
        return None
    return "attn_mask is neither 2-D nor 4-D with broadcastable batch and heads"


def check_cudnn_dropout(call: SdpaCall, target: CudaTarget) -> str | None:
    """Same name (sdp_utils.cpp): cuDNN's dropout probability is a multiple of 1/16."""
    return None if call.dropout * 16 == int(call.dropout * 16) else "cuDNN dropout must be a multiple of 1/16"


def check_cudnn_tensor_shapes(call: SdpaCall, target: CudaTarget) -> str | None:
    """Same name (sdp_utils.cpp), the parts that do not depend on the cuDNN runtime: batch and heads <= 65535,
    head dims multiples of 8 and <= 128 (256 on sm90/sm100 with a new cuDNN: we keep 128, the limit every
    runtime has), key length other than 1."""
    if call.batch > CUDNN_MAX_DIM or call.q_heads > CUDNN_MAX_DIM:
        return "cuDNN attention takes batch and heads up to 65535"
    if call.head_dim > 128 or call.v_dim > 128 or call.head_dim % 8 or call.v_dim % 8:
        return f"cuDNN attention needs head dims that are multiples of 8, up to 128 (got {call.head_dim})"
    return None if call.kv_len != 1 else "cuDNN attention takes no key length of 1"


def check_dtypes_cudnn(call: SdpaCall, target: CudaTarget) -> str | None:
    """check_dtypes_low_precision (sdp_utils.cpp), as used by cuDNN."""
    return check_dtypes_flash_attention(call, CudaTarget(capability=target.capability))


def _sm(target: CudaTarget) -> str:
    return f"{target.capability[0]}{target.capability[1]}"


def _flash_filters() -> tuple:
    """can_use_flash_attention (sdp_utils.cpp), general then dense constraints, in PyTorch's order."""
    return (check_runtime_disabled(FLASH), check_tensor_shapes, check_for_attn_mask, check_head_dim_size_flash,
            check_flash_attention_hardware_support, check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120,
            check_flash_causal_non_square_seqlens, check_dtypes_flash_attention,
            check_batch_size_and_num_heads_dense(supports_gqa=True), check_nonzero_sequence_lengths_dense,
            check_last_dim_stride_equals_1_dense(ignore_singleton_dim=True))


def _efficient_filters(target: CudaTarget) -> tuple:
    """can_use_mem_efficient_attention (sdp_utils.cpp). It has no mask rule: any float or bool mask is taken,
    one that requires grad too (its backward then materializes the bias gradient)."""
    return (check_runtime_disabled(EFFICIENT), check_mem_efficient_hardware_support, check_tensor_shapes,
            check_head_dim_size_mem_efficient, check_nonzero_sequence_lengths_dense,
            check_last_dim_stride_equals_1_dense(ignore_singleton_dim=False),
            check_batch_size_and_num_heads_dense(supports_gqa=target.torch >= EFFICIENT_GQA_SINCE),
            check_dtypes_mem_efficient)


def _cudnn_filters() -> tuple:
    """can_use_cudnn_attention (sdp_utils.cpp), the constraints that can be judged without the cuDNN runtime."""
    return (check_runtime_disabled(CUDNN), check_tensor_shapes, check_dtypes_cudnn, check_attn_mask_shape,
            check_cudnn_hardware_support, check_cudnn_dropout, check_nonzero_sequence_lengths_dense,
            check_last_dim_stride_equals_1_dense(ignore_singleton_dim=True),
            check_batch_size_and_num_heads_dense(supports_gqa=True), check_cudnn_tensor_shapes)


def filters_for(backend: str, target: CudaTarget) -> tuple:
    return {FLASH: _flash_filters, CUDNN: _cudnn_filters}.get(backend, lambda: _efficient_filters(target))()


#: at::Context's default `sdp_priority_order` (torch._C._get_sdp_priority_order() on a fresh process:
#: flash, memory-efficient, math, cuDNN): math accepts everything, so cuDNN runs only when preferred.
DEFAULT_PRIORITY: tuple[str, ...] = (FLASH, EFFICIENT, MATH, CUDNN)


def priority_order(target: CudaTarget) -> tuple[str, ...]:
    """priority_order (sdp_utils.cpp): the context's order; cuDNN, flash, memory-efficient, math where cuDNN
    is preferred (check_prefer_cudnn_attention)."""
    if target.prefer_cudnn:
        return (CUDNN, FLASH, EFFICIENT, MATH)
    return target.priority


@dataclass(frozen=True)
class Choice:
    backend: str
    refused: dict[str, str]  # backend -> the first constraint it failed

    def explain(self) -> str:
        if not self.refused:
            return self.backend
        why = "; ".join(f"{name}: {reason}" for name, reason in self.refused.items())
        return f"{self.backend} ({why})"


def select_sdp_backend(call: SdpaCall, target: CudaTarget) -> Choice:
    """select_sdp_backend (sdp_utils.cpp): the first backend in priority order whose filters all hold.

    Raises:
        ValueError: every backend is refused and math is disabled (PyTorch raises "No available kernel").
    """
    refused: dict[str, str] = {}
    for backend in priority_order(target):
        if backend == MATH:
            if MATH in target.enabled:
                return Choice(MATH, refused)
            continue
        for rule in filters_for(backend, target):
            reason = rule(call, target)
            if reason is not None:
                refused[backend] = reason
                break
        else:
            return Choice(backend, refused)
    raise ValueError("No available SDPA kernel: " + "; ".join(f"{k}: {v}" for k, v in refused.items()))


def padded_head_dim(head_dim: int) -> int:
    """The head dim flash really runs with (and saves): rounded up to a multiple of 8."""
    return -(-head_dim // FLASH_HEAD_DIM_PAD) * FLASH_HEAD_DIM_PAD
