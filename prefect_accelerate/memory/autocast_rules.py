"""CUDA's autocast policy, applied while the activation trace runs under CPU autocast.

The trace runs a bf16/fp16 model on fake CPU tensors under ``torch.autocast("cpu")``, but CPU's autocast
lists are not CUDA's. CUDA runs ``pow``, ``exp``, ``rsqrt``, ``layer_norm``, ``softmax``, ``sum``... in
fp32 (``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``); CPU leaves them in the input's dtype. Which
policy an op gets decides the dtype of what it saves for backward: GPT-2's tanh GELU (``torch.pow(x, 3.0)``)
keeps its MLP intermediates in fp32 on a GPU and in bf16 on CPU, half the bytes.

So for a trace that stands for a CUDA device, every op that has a CPU or a CUDA autocast kernel gets a
Python kernel on the ``AutocastCPU`` key for the duration (`cuda_policy()`), which does what the CUDA
kernel does (``WrapFunction_`` in aten/src/ATen/autocast_mode.h): cast every floating argument to the
autocast dtype (lower_precision_fp) or to fp32 (fp32), set an unset ``dtype`` to fp32 when the first
argument is floating (fp32_set_opt_dtype), append fp32 to ``norm`` (fp32_append_dtype), run in the widest
dtype (promote), refuse ``binary_cross_entropy``; an op that only CPU lists falls through as on CUDA, uncast,
with autocast still on for the ops it is made of (``cross_entropy_loss`` -> ``log_softmax`` in fp32).
Casts of fp32 leaf weights that require grad into the autocast dtype are made once per trace, as
``cached_cast``'s cache does (aten/src/ATen/autocast_mode.cpp). The casts are ordinary ``.to()`` calls made
above autograd, so the tensors backward keeps are the cast ones, exactly as on the GPU.

The lists are transcribed from the main branch's autocast_mode.h (the AT_FORALL_* macros) and
autocast_mode.cpp (``TORCH_LIBRARY_IMPL(aten, Autocast, m)``: the cuDNN convolutions, the banned
``binary_cross_entropy``). Which ops the installed torch gives an ``AutocastCUDA`` kernel is asked from
its dispatcher (`installed_autocast_ops`), and the tests hold the transcription to it, so a torch release that
adds or drops an op shows up there. The registration is process-wide while it lasts (about as long as one
trace): a thread that is not tracing and runs CPU autocast meanwhile gets the promote policy (each op in
the widest dtype of its inputs), which is never less precise than CPU's own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

#: AT_FORALL_LOWER_PRECISION_FP, plus cudnn_convolution and cudnn_convolution_transpose (autocast_mode.cpp).
LOWER_PRECISION_FP = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul",
    "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention", "cudnn_convolution",
    "cudnn_convolution_transpose",
)
#: AT_FORALL_FP32 (rms_norm joined layer_norm there in recent releases).
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
#: AT_FORALL_FP32_SET_OPT_DTYPE (the Dimname overloads are left out: the dispatcher lists none).
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
#: AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE (fp32_append_dtype): the overload and the one it redispatches to.
FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
#: AT_FORALL_PROMOTE.
PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put", "tensordot",
           "scatter_add")
#: autocast_mode.cpp: binary_cross_entropy_banned.
BANNED = ("binary_cross_entropy",)

POLICIES: dict[str, str] = {
    **{name: "lower_precision_fp" for name in LOWER_PRECISION_FP}, **{name: "fp32" for name in FP32},
    **{name: "fp32_set_opt_dtype" for name in FP32_SET_OPT_DTYPE}, **{name: "fp32_append_dtype" for name in FP32_APPEND_DTYPE},
    **{name: "promote" for name in PROMOTE}, **{name: "banned" for name in BANNED},
}

_BANNED_MESSAGE = ("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast; use "
                   "binary_cross_entropy_with_logits or BCEWithLogitsLoss, which combine a sigmoid and the loss")

_REGISTRATION_LOCK = threading.Lock()
_STATE = threading.local()
_op_names: tuple[frozenset[str], frozenset[str]] | None = None


def installed_autocast_ops() -> tuple[frozenset[str], frozenset[str]]:
    """(ops with an AutocastCUDA kernel, ops with an AutocastCPU kernel) in the installed torch, as "name.overload"."""
    global _op_names
    if _op_names is None:
        import torch

        has = torch._C._dispatch_has_kernel_for_dispatch_key
        cuda, cpu = set(), set()
        for qualified in torch._C._dispatch_get_all_op_names():
            if not qualified.startswith("aten::"):
                continue
            name = qualified.removeprefix("aten::")
            if has(qualified, "AutocastCUDA"):
                cuda.add(name)
            if has(qualified, "AutocastCPU"):
                cpu.add(name)
        _op_names = (frozenset(cuda), frozenset(cpu))
    return _op_names


def _overload(name: str) -> Any:
    import torch

    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _eligible(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _map_tensors(value: Any, cast: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(item, cast) for item in value)
    return cast(value) if _eligible(value) else value


def _cast_to(dtype: Any, low: Any) -> Any:
    """cached_cast: a cast copy; fp32 leaf weights that require grad are cast into ``low`` once per trace."""
    import torch

    cache: dict[int, Any] | None = getattr(_STATE, "cache", None)

    def cast(tensor: Any) -> Any:
        if tensor.dtype == dtype:
            return tensor
        cacheable = (cache is not None and dtype == low and tensor.dtype == torch.float32 and tensor.requires_grad
                     and tensor.is_leaf and not tensor._is_view())
        if not cacheable:
            return tensor.to(dtype)
        kept = cache.get(id(tensor))
        if kept is None or kept[0] is not tensor:
            kept = (tensor, tensor.to(dtype))
            cache[id(tensor)] = kept
        return kept[1]

    return cast


def _widest(args: tuple, kwargs: dict, low: Any) -> Any:
    """promote_type / prioritize: fp32 when any floating argument is fp32, else the autocast dtype."""
    import torch

    found = low
    for value in [*args, *kwargs.values()]:
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if _eligible(tensor):
                if tensor.dtype == torch.float32:
                    return torch.float32
                if tensor.dtype != low:  # prioritize raises for a 16-bit type other than the autocast one
                    found = torch.float32
    return found


def _kernel(name: str, policy: str) -> Any:
    import torch
    from torch._C import DispatchKey, DispatchKeySet

    op = _overload(name)
    below = DispatchKeySet(DispatchKey.AutocastCPU)
    dtype_index = next((i for i, arg in enumerate(op._schema.arguments) if arg.name == "dtype"), None)
    target = _overload(FP32_APPEND_DTYPE[name]) if policy == "fp32_append_dtype" else None

    def run(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        low = torch.get_autocast_dtype("cpu")
        if policy == "as is" and getattr(_STATE, "tracing", False):
            # CUDA registers nothing for it: a fallthrough, so the ops it is made of still meet autocast
            # (cross_entropy_loss's log_softmax runs fp32_set_opt_dtype)
            return op.redispatch(keyset.remove(DispatchKey.AutocastCPU), *args, **kwargs)
        with torch._C._ExcludeDispatchKeyGuard(below):
            if not getattr(_STATE, "tracing", False):  # another thread's CPU autocast meanwhile: widest dtype
                cast = _cast_to(_widest(args, kwargs, low), low)
                return op(*_map_tensors(args, cast), **{k: _map_tensors(v, cast) for k, v in kwargs.items()})
            if policy == "unknown":  # CUDA autocasts it, but we have not transcribed how: fp32 keeps the most
                _STATE.unknown.add(name)
                policy_now = "fp32"
            else:
                policy_now = policy
            if policy_now in ("lower_precision_fp", "fp32", "promote"):
                dtype = {"lower_precision_fp": low, "fp32": torch.float32}.get(policy_now) or _widest(args, kwargs, low)
                cast = _cast_to(dtype, low)
                return op(*_map_tensors(args, cast), **{k: _map_tensors(v, cast) for k, v in kwargs.items()})
            if policy == "fp32_set_opt_dtype":
                if args and _eligible(args[0]):
                    if dtype_index is not None and len(args) > dtype_index:
                        if args[dtype_index] is None:
                            args = (*args[:dtype_index], torch.float32, *args[dtype_index + 1:])
                    elif kwargs.get("dtype") is None:
                        kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
            if policy == "fp32_append_dtype":
                first = args[0]
                return target(*args, **kwargs, dtype=torch.float32 if _eligible(first) else first.dtype)
            if policy == "banned":
                raise RuntimeError(_BANNED_MESSAGE)
            return op(*args, **kwargs)

    return run


@contextlib.contextmanager
def cuda_policy() -> Iterator[set[str]]:
    """While this thread traces: ops under ``torch.autocast("cpu")`` follow CUDA's autocast policy.

    Yields the set that collects the ops the trace met whose CUDA policy is not transcribed (a newer torch):
    they run in fp32, which keeps the most, and the estimate names them. The caller holds the trace lock
    (memory/attention.py), so one registration is alive at a time.
    """
    import warnings

    import torch

    cuda, cpu = installed_autocast_ops()
    names = sorted(cuda | cpu)  # the installed torch says which ops; the transcription says how
    with _REGISTRATION_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": on purpose, undone below
        library = torch.library.Library("aten", "IMPL")
        try:
            for name in names:
                policy = POLICIES.get(name, "unknown" if name in cuda else "as is")
                library.impl(name, _kernel(name, policy), "AutocastCPU", with_keyset=True)
            _STATE.tracing, _STATE.cache, _STATE.unknown = True, {}, set()
            try:
                yield _STATE.unknown
            finally:
                _STATE.tracing, _STATE.cache = False, None
        finally:
            library._destroy()
