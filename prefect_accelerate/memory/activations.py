"""Activation memory, measured rather than guessed: one forward pass on fake tensors.

Accelerate counts no activations, and that is where users find the largest gaps between its estimate
and real usage (reference prefect-and-peers §10.21). A formula per architecture would be wrong for every
architecture it was not written for, so we run the real forward of the model that will be trained, with
a real loss, on fake tensors (PyTorch's FakeTensorMode: shapes and dtypes, no data, no allocation), and
add up every tensor autograd saves for backward (`saved_tensors_hooks`). That is the memory backward
needs, for this model's own code; attention and dropout run as a CUDA device runs them (the kernel its
SDPA dispatcher would pick, the fused 1-byte dropout mask: memory/attention.py), or as CPU runs them
with ``device_type="cpu"``.

Fake CPU tensors rather than meta tensors: meta tensors take SDPA's math path and ignore autocast.

Deep stacks are traced shallow (memory/depth.py): a few blocks holding every kind of block the stack has,
each further block counted like the last traced block of its kind (tests check this against full-depth
traces). A 70B-shaped model then traces in a fraction of a second instead of seconds.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from prefect_accelerate.errors import EstimateError
from prefect_accelerate.memory.attention import cuda_kernels
from prefect_accelerate.memory.choices import UNKNOWN_AUTOCAST
from prefect_accelerate.memory.depth import NotOneCallPerBlock, checkpoint_layers
from prefect_accelerate.memory.measured import mel_frames
from prefect_accelerate.memory.models import ActivationProfile

DEFAULT_MAX_SEQ_LEN = 2048
FALLBACK_SEQ_LEN = 512

_SINGLE_LABEL_SUFFIXES = ("ForSequenceClassification", "ForImageClassification", "ForAudioClassification", "ForMultipleChoice")
#: the first of these a config has bounds its tokens (max_target_positions: the decoder of a speech model)
_POSITION_LIMITS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_target_positions")


def default_seq_len(config: Any) -> int:
    """The sequence length used when the user gives none: the model's maximum, capped at 2048."""
    limit = _position_limit(config)
    return min(limit, DEFAULT_MAX_SEQ_LEN) if limit else FALLBACK_SEQ_LEN


def _position_limit(config: Any) -> int | None:
    for attr in _POSITION_LIMITS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def trace_activations(
    model: Any,
    *,
    library: str,
    batch_size: int,
    seq_len: int | None,
    precision_mode: str,
    layout: list[int] | None = None,
    force_flash: bool = False,
    device_type: str = "cuda",
    capability: tuple[int, int] | None = None,
    use_cache: bool | None = None,
    checkpointing: bool = False,
) -> ActivationProfile:
    """Run one forward pass of a fake-tensor model and measure what backward will need.

    Args:
        model: the trained class with fake CPU tensors (build.build_trained_model, then build.to_fake),
            weights already in the dtype of ``precision_mode`` (see `weight_dtype`).
        library: ``transformers`` or ``timm`` (decides the inputs and the loss).
        batch_size: samples per device.
        seq_len: tokens per sample (text models); None uses the model's maximum, capped at 2048.
        precision_mode: ``fp32``; ``autocast-bf16``/``autocast-fp16`` (fp32 weights under autocast, as
            DDP with Accelerate's mixed precision); ``bf16``/``fp16`` (16-bit weights, as DeepSpeed);
            ``bf16+autocast``/``fp16+autocast`` (16-bit weights under autocast, as FSDP).
        layout: when ``model`` is a shallow copy (memory/depth.py), for each block of the real stack the traced
            block it repeats.
        force_flash: every SDPA call runs as flash attention (``--attn_implementation flash_attention_2``,
            which keeps what SDPA's flash kernel keeps).
        device_type: ``cuda`` stands in CUDA's attention and dropout kernels (memory/attention.py);
            ``cpu`` keeps CPU's own, for comparisons with real training on CPU.
        capability: the CUDA compute capability whose kernel rules apply (None: this machine's GPU, else 9.0).
        use_cache: None runs the forward as training runs it (transformers' own ``use_cache``); a forward that
            fails then is run again with False, as gradient checkpointing runs it (and the report says so).
        checkpointing: the run checkpoints its blocks: a second forward measures each block's rise without its
            saved tensors (`block_checkpointed_rises`); skipped otherwise, since nothing else reads them.

    Returns:
        An ActivationProfile; ``method="not estimated"`` with a note when the inputs are not supported
        or the forward cannot run on fake tensors (data-dependent code).

    Raises:
        EstimateError: ``seq_len`` is longer than the model's position embeddings allow.
        NotOneCallPerBlock: ``layout`` was given and the model did not call each block once, in order.
    """
    import torch

    half = {"bf16": torch.bfloat16, "fp16": torch.float16}
    autocast_dtype = None
    if precision_mode.startswith("autocast-"):
        autocast_dtype = half[precision_mode.removeprefix("autocast-")]
    elif precision_mode.endswith("+autocast"):
        autocast_dtype = half[precision_mode.split("+")[0]]
    model.train()

    config = getattr(model, "config", None)
    used_seq: int | None = None
    if library == "timm":
        size = tuple(getattr(model, "pretrained_cfg", {}).get("input_size") or (3, 224, 224))
        description = f"{batch_size} image(s) of {'x'.join(map(str, size))}"
    elif model.main_input_name == "input_ids":
        used_seq = seq_len or default_seq_len(config)
        limit = _position_limit(config)
        if seq_len and limit and seq_len > limit and _absolute_positions(model):
            raise EstimateError(
                f"--seq_len {seq_len} is longer than {type(model).__name__} can take: its position embeddings stop at "
                f"{limit} tokens (config `{next(a for a in _POSITION_LIMITS if getattr(config, a, None) == limit)}`). "
                f"Use --seq_len {limit} or less."
            )
        description = f"{batch_size} sequence(s) of {used_seq} tokens"
    elif mel_frames(model):
        used_seq = seq_len or default_seq_len(config)
        description = (f"{batch_size} clip(s) of {config.num_mel_bins} mel bins x {mel_frames(model)} frames, "
                       f"{used_seq} target tokens")
    elif model.main_input_name == "pixel_values":
        image = _image_size(config)
        description = f"{batch_size} image(s) of {getattr(config, 'num_channels', 3)}x{image[0]}x{image[1]}"
    else:
        return ActivationProfile(
            method="not estimated", batch_size=batch_size, seq_len=seq_len, input_description=f"`{model.main_input_name}`",
            precision_mode=precision_mode,
            note=(f"Activations are not estimated: {type(model).__name__} takes `{model.main_input_name}`; "
                  "only token ids and images are supported."),
        )

    params = {id(p) for p in model.parameters()}
    recorder = _SavedTensorRecorder(params)
    layers = checkpoint_layers(model)
    handles = [layer.register_forward_pre_hook(recorder.enter_layer, with_kwargs=True) for layer in layers]
    handles += [layer.register_forward_hook(recorder.leave_layer) for layer in layers]
    mode = _fake_mode_of(model)
    watch = _param_casts(recorder, params) if autocast_dtype is not None else contextlib.nullcontext()
    kernels = cuda_kernels(force_flash, capability) if device_type == "cuda" else contextlib.nullcontext(None)
    cache: list[Any] = []
    recorder.forward_meter = forward = _LiveBytes()
    try:
        with mode, watch, _moe_without_grouped_mm(), _unpadded_masks(), _no_layer_dropped(), _deep_copies_clone(), \
                kernels as kernel_log, forward, \
                torch.autograd.graph.saved_tensors_hooks(recorder.pack, _unpack):
            with _autocast(autocast_dtype):
                if library == "timm":
                    result = model(torch.zeros((batch_size, *size), dtype=_float_dtype(model)))
                    loss = torch.nn.functional.cross_entropy(result.float(), torch.zeros(batch_size, dtype=torch.long))
                    outputs = [result, loss]
                else:
                    result = model(**_transformers_inputs(model, batch_size, used_seq, use_cache))
                    outputs = list(_tensors_in(result))
                    cache = _cache_layers(result)
                    loss = result.get("loss") if isinstance(result, dict) else getattr(result, "loss", None)
    except EstimateError:
        raise
    except Exception as error:  # data-dependent control flow, unsupported ops, custom code
        first_line = (str(error).splitlines() or [""])[0][:200]
        if use_cache is None and library == "transformers" and getattr(config, "use_cache", False) \
                and _takes_use_cache(model):
            # transformers' training-time KV cache is what failed for some models (hybrid linear-attention stacks);
            # gradient checkpointing turns it off, so that run can be measured
            for handle in handles:
                handle.remove()
            handles.clear()
            retried = trace_activations(model, library=library, batch_size=batch_size, seq_len=seq_len,
                                        precision_mode=precision_mode, layout=layout, force_flash=force_flash,
                                        device_type=device_type, capability=capability, use_cache=False,
                                        checkpointing=checkpointing)
            if retried.method == "traced":
                why = (f"Traced without transformers' KV cache: the forward of {type(model).__name__} fails with it "
                       f"({type(error).__name__}: {first_line}); gradient checkpointing turns it off, and a run "
                       "without checkpointing may fail the same way.")
                return retried.model_copy(update={"note": f"{retried.note} {why}".strip()})
        return ActivationProfile(
            method="not estimated", batch_size=batch_size, seq_len=used_seq, input_description=description,
            precision_mode=precision_mode,
            note=(f"Activations are not estimated: the forward of {type(model).__name__} does not run on fake tensors "
                  f"({type(error).__name__}: {first_line})."),
        )
    finally:
        for handle in handles:
            handle.remove()

    recorder.forward_done()
    checkpointed_rises = _checkpointed_rises(
        model, layers if checkpointing else [], lambda: _forward_contexts(mode, device_type, force_flash, capability),
        lambda: _forward_once(model, library, batch_size, used_seq, size if library == "timm" else None, autocast_dtype))
    # a KV cache the output holds: its tensors are mostly the keys/values attention saved anyway; any it
    # holds besides those (transformers may cache keys in another dtype) are alive from forward on
    # (per cache layer, counting each storage once, at the first layer that holds it)
    cache_all, cache_unsaved, counted = [], [], set()
    for layer in cache:
        layer_all = layer_unsaved = 0
        for tensor in layer:
            base = tensor._base if tensor._base is not None else tensor
            if id(base) in counted:
                continue
            counted.add(id(base))
            layer_all += _nbytes(base)
            if id(base) not in recorder.seen:
                layer_unsaved += _nbytes(base)
        cache_all.append(layer_all)
        cache_unsaved.append(layer_unsaved)
    retained = 0
    for tensor in outputs:
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in recorder.seen and id(base) not in params:
            recorder.seen.add(id(base))
            retained += _nbytes(base)
            recorder.largest = max(recorder.largest, _nbytes(base))
    count = len(recorder.layer_index)
    measured = _measure_backward(loss, recorder, mode, list(model.parameters()))  # last: it frees the graph
    every_block = bool(count) and bool(measured.blocks) and len(measured.blocks) == measured.expected
    block_peak = max(measured.blocks.values()) if every_block else max(recorder.block_peak.values(), default=0)
    per_layer = [recorder.saved_in[i] for i in range(count)]
    inputs = [recorder.inputs_of[i] for i in range(count)]
    casts = [recorder.casts_in[i] for i in range(count)]
    carries = [recorder.carry.get(i, 0) for i in range(count)]
    # per block call, for the phases of backward one by one (strategies._block_phases): at the highest point of
    # its own backward, what it saved plus its activations' rise, and the weights' gradients made by then; and
    # whose gradients its backward makes (a call with no backward, under no_grad, holds and makes none)
    phases = measured.phases if every_block else {}
    peaks = [recorder.saved_in[i] + phases[i].rise if i in phases else 0 for i in range(count)] if phases else []
    peak_grads = [phases[i].rise_gradients if i in phases else 0 for i in range(count)] if phases else []
    block_params = _block_parameters(model, recorder.layer_index, set(phases)) if phases else []
    # a checkpointed block is recomputed at the start of its backward, with its incoming gradient alive: the
    # recomputing forward holds what the block's forward rose to (its saved tensors and the temporaries of its
    # worst moment: a dropout's mask being made, an expert router's fp32 copy)
    recomputes = [forward.rises.get(i, 0) + phases[i].extra if i in phases else 0 for i in range(count)] if phases else []
    waiting = [measured.waiting.get(i, 0) for i in range(count)] if phases else []
    unsaved_rises = [checkpointed_rises[i] for i in range(count)] if sorted(checkpointed_rises) == list(range(count)) else []
    # saved outside the blocks, by where: before block g (g = 0..count), the last being the head's
    gaps = [recorder.outside_gaps.get(g, 0) for g in range(count + 1)]
    note = ""
    repeats = _repeats(layout, recorder.layer_index, layers)
    if repeats:
        def spread(figures: list) -> list:
            return [figures[j] for j in repeats] if figures else figures

        per_layer, inputs, casts, carries = spread(per_layer), spread(inputs), spread(casts), spread(carries)
        peaks, peak_grads, block_params, recomputes = spread(peaks), spread(peak_grads), spread(block_params), spread(recomputes)
        waiting, unsaved_rises = spread(waiting), spread(unsaved_rises)
        # saved outside the blocks before block i like before the block it repeats; the head stays the head
        gaps = [gaps[j] for j in repeats] + gaps[-1:]
        note = (f"Traced {count} of {len(repeats)} blocks, which hold every kind of block the stack has; each "
                "further block counted like the last traced block of its kind.")
        # a cache with one layer per block: each further block holds what the block it repeats holds (a Mamba block
        # of a hybrid stack holds no keys); a cache laid out otherwise is scaled by the blocks
        if len(cache_all) == count:
            cache_all, cache_unsaved = [cache_all[j] for j in repeats], [cache_unsaved[j] for j in repeats]
        else:
            cache_all = [sum(cache_all) * len(repeats) // count]
            cache_unsaved = [sum(cache_unsaved) * len(repeats) // count]
    cast_total = recorder.cast_outside + sum(casts)
    head = measured.head if every_block else None
    return ActivationProfile(
        method="traced", batch_size=batch_size, seq_len=used_seq, input_description=description,
        precision_mode=precision_mode,
        saved_bytes=recorder.outside + sum(per_layer),
        outside_layers_bytes=recorder.outside,
        outside_after_layers_bytes=recorder.outside_after,
        per_layer_bytes=per_layer,
        layer_input_bytes=sum(inputs),
        block_input_bytes=inputs,
        block_backward_peaks=peaks,
        block_backward_gradient_bytes=peak_grads,
        block_parameters=block_params,
        block_cast_bytes=casts,
        block_recompute_peaks=recomputes,
        block_backward_waiting_bytes=waiting,
        block_checkpointed_rises=unsaved_rises,
        outside_gap_bytes=gaps,
        retained_output_bytes=retained,
        largest_tensor_bytes=recorder.largest,
        largest_layer_tensor_bytes=recorder.largest_in_layers,
        block_backward_peak_bytes=block_peak,
        block_backward_measured=every_block,
        block_backward_rise_bytes=max(measured.rises.values()) if every_block else 0,
        head_backward_bytes=head.rise if head is not None else 0,
        head_backward_gradient_bytes=head.rise_gradients if head is not None else 0,
        head_gradient_bytes=head.gradients if head is not None else 0,
        head_left_bytes=head.left_bytes if head is not None else 0,
        head_backward_measured=head is not None,
        block_saved_input_bytes=min((recorder.saved_inputs_in[i] for i in range(count)), default=0),
        unreached_parameters=_unreached_parameters(model, measured.unreached, repeats) if every_block else 0,
        forward_peak_bytes=_forward_peak(forward, count, repeats) if repeats else forward.peak,
        block_forward_rise_bytes=max(forward.rises.values(), default=0),
        block_carry_bytes=carries,
        forward_measured=True,
        autocast_weight_copy_bytes=cast_total,
        cache_bytes=sum(cache_all),
        cache_unsaved_bytes=sum(cache_unsaved),
        attention_implementation=(getattr(config, "_attn_implementation", None) if library == "transformers"
                                  else "sdpa" if kernel_log is not None and kernel_log.kernels else None),
        attention_kernels=list(kernel_log.kernels) if kernel_log is not None else [],
        attention_backward_bytes=kernel_log.backward_bytes if kernel_log is not None else 0,
        attention_detail=_kernel_detail(kernel_log),
        note=note,
    )


def _kernel_detail(log: Any) -> str:
    """Why each kernel ran, in words: the target, the backends refused and head-dim padding."""
    if log is None or not log.kernels:
        return ""
    target = log.target
    parts = [f"rules of torch {target.torch[0]}.{target.torch[1]} for compute capability {target.capability[0]}.{target.capability[1]}"]
    if log.force_flash:
        parts.append("flash_attention_2 keeps what SDPA's flash kernel keeps")
    parts += [f"{kernel}: {why}" for kernel, why in log.reasons.items()]
    parts += [f"head dim {a} padded to {b} for flash" for a, b in sorted(log.padded_head_dims)]
    if log.backward_bytes:
        parts.append("memory-efficient backward materializes the gradient of a mask that requires grad")
    if log.unknown_autocast:
        parts.append(f"{UNKNOWN_AUTOCAST}: {', '.join(sorted(log.unknown_autocast))} (run in fp32)")
    return "; ".join(parts)


class _SavedTensorRecorder:
    """Adds up distinct tensors saved for backward, per checkpointing block, leaving parameters out.

    Autocast's 16-bit copies of weights are counted apart (``casts_in``, ``cast_outside``): they are
    weights, not activations, and only DDP keeps them (FSDP and DeepSpeed compute in 16-bit already).
    """

    def __init__(self, params: set[int]) -> None:
        self.params = params
        self.seen: set[int] = set()
        self.keep: list[Any] = []  # holds every counted tensor so that no id is reused while we count
        self.casts: set[int] = set()
        self.outside = 0
        self.outside_after = 0
        self.outside_gaps: dict[int, int] = {}  # blocks done when it was saved -> bytes saved outside the blocks
        self.largest_in_layers = 0
        self.cast_outside = 0
        self.largest = 0
        #: one entry per block call, in forward order: the module's id (a model that loops over its blocks, such
        #: as a recurrent-depth model, calls one module several times; checkpointing wraps each call)
        self.layer_index: list[int] = []
        self.saved_in: dict[int, int] = {}
        self.casts_in: dict[int, int] = {}
        self.inputs_of: dict[int, int] = {}
        #: per block: the largest (bytes saved so far + 2 x the tensor just saved), in forward order
        self.block_peak: dict[int, int] = {}
        self.current: int | None = None
        self.input_ids: set[int] = set()
        #: per block: the tensor its backward starts from (its output's gradient) and ends at (its input's)
        self.block_out: dict[int, Any] = {}
        self.block_in: dict[int, Any] = {}
        #: per block: ids of its tensor inputs, and the bytes of them it saves itself (checkpointing keeps those
        #: as the block's inputs; recomputing the block does not make them again)
        self.own_inputs: dict[int, set[int]] = {}
        self.saved_inputs_in: dict[int, int] = {}
        #: counts live memory through the forward: its peak, and each block call's rise above its start
        self.forward_meter: _LiveBytes | None = None
        #: per block call: what the model still held of the previous call's outputs when this one started (`carry_of`)
        self.carry: dict[int, int] = {}
        self._last_output: Any = None

    def pack(self, tensor: Any) -> Any:
        base = tensor._base if tensor._base is not None else tensor
        key = id(base)
        if key in self.params or key in self.seen:
            return tensor
        self.seen.add(key)
        self.keep.append(base)
        size = _nbytes(base)
        if key in self.casts:
            if self.current is None:
                self.cast_outside += size
            else:
                self.casts_in[self.current] += size
            return tensor
        self.largest = max(self.largest, size)
        if self.current is None:
            self.outside += size
            if self.layer_index:  # after the first block: the head, the final norm, the loss
                self.outside_after += size
            # by where forward saved it: before block g (g blocks done; g = the last one's count: the head). An
            # encoder-decoder saves between its stacks (the encoder's final norm, the decoder's embeddings), and
            # backward frees that only after the blocks that come later
            gap = len(self.layer_index)
            self.outside_gaps[gap] = self.outside_gaps.get(gap, 0) + size
        else:
            self.largest_in_layers = max(self.largest_in_layers, size)
            self.saved_in[self.current] += size
            if key in self.own_inputs.get(self.current, ()):
                self.saved_inputs_in[self.current] += size
            # when backward reaches the op that saved this, everything the block saved up to here is still held,
            # and a gradient of this size (and the one it produces) is in flight
            self.block_peak[self.current] = max(self.block_peak[self.current], self.saved_in[self.current] + 2 * size)
        return tensor

    def enter_layer(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self.current is not None:
            return
        index = len(self.layer_index)
        self.layer_index.append(id(module))
        inputs = [tensor for value in list(args) + list(kwargs.values()) for tensor in _tensors_in(value)]
        # CPython's reference count tells whether the model still holds the previous call's output: more than a
        # fresh object bound the same way has (a local and getrefcount's argument; newer interpreters may borrow
        # the argument, so the baseline is asked, not assumed). Let go of it before this call's start is counted
        last, self._last_output = self._last_output, None
        alone = object()
        held = last is not None and sys.getrefcount(last) > sys.getrefcount(alone)
        self.carry[index] = carry_of(last, inputs) if held else 0
        del last
        if self.forward_meter is not None:
            self.forward_meter.open(index)
        for table in (self.saved_in, self.casts_in, self.inputs_of, self.block_peak, self.saved_inputs_in):
            table.setdefault(index, 0)
        self.current = index
        # what activation checkpointing keeps of this block: its floating-point tensor inputs. They are not held
        # here (a mask or position table the stack passes to every block dies when the stack returns, before the
        # head runs, and the forward's live count must see that): an id leaves `input_ids` when its tensor dies,
        # so a later tensor that gets the id is counted
        for tensor in inputs:
            base = tensor._base if tensor._base is not None else tensor
            self.own_inputs.setdefault(index, set()).add(id(base))
            if tensor.requires_grad and tensor.is_floating_point():
                self.block_in.setdefault(index, tensor)
            key = id(tensor)
            if key not in self.input_ids and key not in self.params and tensor.is_floating_point():
                self.input_ids.add(key)
                weakref.finalize(tensor, self.input_ids.discard, key)
                self.inputs_of[index] += _nbytes(tensor)

    def forward_done(self) -> None:
        """Let go of the last block call's output, so that backward sees it freed when the model lets go of it."""
        self._last_output = None

    def leave_layer(self, module: Any, args: tuple, output: Any) -> None:
        if self.current is not None and self.layer_index[self.current] == id(module):
            first = next((t for t in _tensors_in(output) if t.requires_grad and t.is_floating_point()), None)
            if first is not None:
                self.block_out[self.current] = first
            self._last_output = output
            if self.forward_meter is not None:
                self.forward_meter.close(self.current)
            self.current = None


def carry_of(output: Any, inputs: list[Any]) -> int:
    """The bytes of a block call's output, still held by the model when the next block call starts, besides that
    call's inputs. A stack that runs ``outputs = block(...); hidden = outputs[0]`` keeps the whole tuple, attention
    weights included, until the next call returns (the caller asks whether it is held); ``hidden = block(...)[0]``
    keeps nothing, and a block that returns its hidden state alone passes it on as the next call's input. Without
    checkpointing such weights are mostly saved for backward anyway; under checkpointing they are not, and the
    forward holds them beside the next block's temporaries."""
    if hasattr(output, "untyped_storage"):
        return 0
    taken = {id(tensor.untyped_storage()) for tensor in inputs}
    held: dict[int, int] = {}
    for tensor in _tensors_in(output):
        storage = tensor.untyped_storage()
        if tensor.is_floating_point() and id(storage) not in taken:
            held[id(storage)] = storage.nbytes()
    return sum(held.values())


class _BackwardFigures:
    """What a backward on the fake graph measured (`_measure_backward`); empty when it could not run."""

    def __init__(self, blocks: dict[int, int] | None = None, rises: dict[int, int] | None = None,
                 head: _Phase | None = None, phases: dict[int, _Phase] | None = None, expected: int = 0, unreached: set[int] | None = None,
                 waiting: dict[int, int] | None = None) -> None:
        #: ids of trainable parameters the loss gave no gradient (an unused cross-attention, a table no input
        #: indexes): they get no .grad and no optimizer state
        self.unreached = unreached or set()
        self.blocks = blocks or {}  # block -> its saved tensors + its rise: the most its own backward holds
        #: the block calls whose output requires grad (a call under no_grad, as a model that loops its blocks
        #: may make, has no backward); the figures are complete when every one of them was measured
        self.expected = expected
        self.rises = rises or {}  # block -> its gradient in plus the most live memory rose above its start
        self.head = head  # the head's phase: from backward's start until the first block's
        self.phases = phases or {}  # block -> its phase, with the gradients apart
        self.waiting = waiting or {}  # block -> what later blocks' backward left alive when its own began


def _measure_backward(loss: Any, recorder: _SavedTensorRecorder, mode: Any, params: list[Any]) -> _BackwardFigures:
    """Run backward on the fake graph and measure what its phases hold beyond what forward saved.

    Per block: its saved tensors, the gradient it starts from and the largest rise of live memory while its
    backward runs: every tensor its backward code makes (a custom autograd Function's own arithmetic, the
    math attention's score gradients), less its saved tensors as backward frees them. For the head (the loss,
    the output layer, the final norm: from backward's start to the first block): the largest rise. Fake
    tensors allocate nothing, so what is live is counted by storage (`_LiveBytes`). A weight's gradient
    leaves the count of activations once accumulated into ``.grad`` (the layouts count gradients, sharded or
    not); the head's phase keeps the ones it made apart, since they stay on top of the activations from then
    on. Blocks whose backward could not be followed are left out; the caller then keeps the forward's
    bound. The graph is freed afterwards, as a real backward frees it.
    """
    if loss is None or not getattr(loss, "requires_grad", False) or not recorder.block_out:
        return _BackwardFigures()
    meter = _LiveBytes()
    expected = len(recorder.block_out)
    for tensor in recorder.keep:  # what forward saved: alive when backward starts, freed as it goes
        meter.track(tensor)
    handles = [tensor.register_hook(lambda grad, index=index: meter.enter(index, grad))
               for index, tensor in recorder.block_out.items()]
    handles += [tensor.register_hook(lambda grad, index=index: meter.leave(index))
                for index, tensor in recorder.block_in.items()]
    handles += [p.register_post_accumulate_grad_hook(meter.gradient_made) for p in params if p.requires_grad]
    handles += [p.register_hook(meter.weight_gradient) for p in params if p.requires_grad]
    for p in params:
        p.grad = None
    recorder.keep.clear()
    recorder.block_out.clear()
    recorder.block_in.clear()
    meter.start_head()
    try:
        with mode, meter:
            loss.backward()
    except Exception:  # noqa: BLE001 - a backward fake tensors cannot run: the forward's bounds stand
        return _BackwardFigures()
    finally:
        for handle in handles:
            handle.remove()
    unreached = {id(p) for p in params if p.requires_grad and p.grad is None}
    return _BackwardFigures(blocks={index: recorder.saved_in[index] + rise for index, rise in meter.rises.items()},
                            rises=dict(meter.rises), head=meter.head, expected=expected, unreached=unreached,
                            waiting=dict(meter.waiting),
                            phases={key: phase for key, phase in meter.phases.items() if key != "head" and phase.ended})


class _LiveBytes:
    """Counts the bytes of live tensor storage while backward runs on fake tensors (a dispatch mode).

    Each storage is counted once, from the op that made it (or from the start, for what forward saved) until
    Python frees it, as the allocator would see it; an op that writes into one of its inputs adds nothing.
    `enter` and `leave` bracket one block's backward (hooks on its output and its input): ``rises[block]``
    is the gradient it started from plus the most live memory rose above its start meanwhile.

    A weight's gradient is counted apart (`gradient_made`, from its post-accumulate hook): it does not grow
    with the batch as the rest does, and it stays until the optimizer step. Each phase (the head's, from
    `start_head` until the first block's backward begins, and each block's) is also followed in both parts
    (`phases`, a `_Phase` each): at its highest total, how much was activations and how much gradients. A
    gradient is made by an ordinary op before autograd accumulates it, so when it is accumulated it moves to
    the gradient side of that record, if it was alive there. What the head made and is still alive when the
    first block begins (a tied embedding's gradient, which autograd holds until the embedding's own backward
    adds to it) is kept too.
    """

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        meter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
                out = func(*args, **(kwargs or {}))
                meter.made(args, kwargs, out, func)
                return out

        self._mode = _Mode()
        self.live = 0
        self.grads = 0  # weights' gradients made so far (not in `live`)
        self._finalizers: dict[int, Any] = {}
        self._open: dict[Any, list[int]] = {}  # block -> [live at its start, highest live since, grad in]
        self.rises: dict[int, int] = {}
        self.phases: dict[Any, _Phase] = {}  # "head" or a block -> its record, open or ended
        self._running: dict[Any, _Phase] = {}  # the phases still open
        self._grad_storage: dict[int, tuple[int, int]] = {}  # parameter -> (storage key, bytes) of its .grad
        self.peak = 0  # the most live at once since counting began
        # for a forward: live at each block's start and end, the peak before the first block, the highest since
        # the last block ended (the head's); a shallow trace's peak is redrawn for the whole stack from these
        self.starts: dict[Any, int] = {}
        self.ends: dict[Any, int] = {}
        self.before_blocks: int | None = None
        self.since_last_end = 0
        #: per block: what earlier-run phases of backward left alive when its backward began (`enter`)
        self.waiting: dict[int, int] = {}
        self._waiting_in: dict[int, _Waiting] = {}  # storage -> its record, while it is alive

    def __enter__(self) -> _LiveBytes:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)

    @property
    def head(self) -> _Phase | None:
        """The head's phase once it has ended (the first block's backward began)."""
        phase = self.phases.get("head")
        return phase if phase is not None and "head" not in self._running else None

    def track(self, tensor: Any) -> None:
        import weakref

        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._finalizers:
            return
        size = storage.nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)
        self.since_last_end = max(self.since_last_end, self.live)
        self._finalizers[key] = weakref.finalize(storage, self._freed, key, size)
        for mark in self._open.values():
            mark[1] = max(mark[1], self.live)
        for phase in self._running.values():
            phase.made(key, size, self.live, self.grads)

    def forget(self, tensor: Any) -> None:
        """Stop counting a tensor's storage."""
        if tensor is None:
            return
        storage = tensor.untyped_storage()
        finalizer = self._finalizers.pop(id(storage), None)
        if finalizer is not None and finalizer.detach() is not None:
            self.live -= storage.nbytes()

    def gradient_made(self, parameter: Any) -> None:
        """A weight's gradient was accumulated into ``.grad``: count it as a gradient from now on."""
        grad = parameter.grad
        if grad is None:
            return
        storage = grad.untyped_storage()
        key, size = id(storage), storage.nbytes()
        before = self._grad_storage.get(id(parameter))
        if before is not None and before[0] != key:
            self.grads -= before[1]  # a second contribution made a new tensor; the old one is gone
        if before is None or before[0] != key:
            self.grads += size
        self._grad_storage[id(parameter)] = (key, size)
        self.forget(grad)
        for phase in self.phases.values():
            phase.became_gradient(key, size)
        for phase in self._running.values():
            phase.note(self.live, self.grads)

    def weight_gradient(self, grad: Any) -> None:
        """A weight's summed gradient, about to be accumulated (a hook on the weight): whatever it was summed in
        is a gradient, not an activation's, and leaves the blocks' `waiting` counts."""
        record = self._waiting_in.pop(id(grad.untyped_storage()), None)
        if record is not None:
            record.was_a_weights_gradient(self.waiting)

    def _freed(self, key: int, size: int) -> None:
        self.live -= size
        self._finalizers.pop(key, None)
        self._waiting_in.pop(key, None)  # it waited as an activation's gradient, and its id may now be reused
        for phase in self.phases.values():  # ended ones too: Python may give the next storage this id
            phase.freed(key)

    def made(self, args: Any, kwargs: Any, out: Any, func: Any = None) -> None:
        given = list(_tensors_in(list(args) + list((kwargs or {}).values())))
        inputs = {id(t.untyped_storage()) for t in given}
        made = [tensor for tensor in _tensors_in(out) if id(tensor.untyped_storage()) not in inputs]
        for tensor in made:
            self.track(tensor)
        # autograd sums the shares of one gradient out of place (`aten.add` of equal shapes): a share that waited
        # is then part of the sum, and goes where the sum goes (a weight's gradient, `weight_gradient`)
        if self._waiting_in and len(made) == 1 and str(func) == "aten.add.Tensor" \
                and all(t.shape == made[0].shape for t in given):
            shares = [self._waiting_in[key] for key in inputs if key in self._waiting_in]
            if shares:
                storage = made[0].untyped_storage()
                self._waiting_in.setdefault(id(storage), _Waiting(storage.nbytes())).shares += shares

    def open(self, key: Any, extra: int = 0) -> None:
        """Start following the rise of live memory for ``key`` (``extra``: bytes to count on top, already live)."""
        if key not in self._open and key not in self.rises:
            self._open[key] = [self.live, self.live, extra]
            self.starts[key] = self.live
            if self.before_blocks is None:
                self.before_blocks = self.peak

    def close(self, key: Any) -> None:
        mark = self._open.pop(key, None)
        if mark is not None:
            start, highest, extra = mark
            self.rises[key] = extra + highest - start
            self.ends[key] = self.since_last_end = self.live

    def start_head(self) -> None:
        self._begin("head", 0)

    def _begin(self, key: Any, extra: int) -> None:
        if key not in self.phases:
            self.phases[key] = self._running[key] = _Phase(self.live, self.grads, extra)

    def _end(self, key: Any, incoming: int | None = None) -> None:
        phase = self._running.pop(key, None)
        if phase is not None:
            phase.end(self.grads, incoming)

    def enter(self, index: int, grad: Any) -> None:
        incoming = id(grad.untyped_storage()) if grad is not None else None
        if "head" in self._running:
            self._end("head", incoming)
        # What the backward of later blocks made and still holds, besides this block's incoming gradient: the
        # gradient of a tensor several blocks take (T5's position bias, made by the first block and passed to the
        # others; an encoder's output every decoder block attends to) is summed as each of them runs backward and
        # waits until the backward of what made it. The block after this one may not have ended yet (its input's
        # gradient is this block's incoming one, and the hook that starts this block can run first), so its
        # storages still alive count too. A weight's gradient waits the same way when one module runs in several
        # block calls (autograd sums its shares before accumulating it once): that is a gradient, counted as one,
        # and leaves this count when the weight's hook sees it (`weight_gradient`).
        if index not in self.waiting:
            self.waiting[index] = 0
            for key, phase in self.phases.items():
                if key == "head":
                    continue
                for storage, size in (phase.left if phase.ended else phase.alive).items():
                    if storage != incoming:
                        self.waiting[index] += size
                        self._waiting_in.setdefault(storage, _Waiting(size)).blocks.append(index)
        self.open(index, _nbytes(grad))
        self._begin(index, _nbytes(grad))

    def leave(self, index: int) -> None:
        self.close(index)
        self._end(index)


class _Waiting:
    """A storage counted in the `waiting` of some blocks (``blocks``), and the waiting storages summed into it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.blocks: list[int] = []
        self.shares: list[_Waiting] = []
        self.settled = False

    def was_a_weights_gradient(self, waiting: dict[int, int]) -> None:
        """It, and every share summed into it, was a weight's gradient: out of every block's count."""
        stack = [self]
        while stack:
            record = stack.pop()
            if record.settled:
                continue
            record.settled = True
            for index in record.blocks:
                waiting[index] -= record.size
            stack += record.shares


class _Phase:
    """One phase of backward (the head's, or one block's) for `_LiveBytes`.

    At its highest total (activations risen above its start + gradients made since): ``rise`` (the
    activations' part, with ``extra``, bytes already live that belong to it, such as a block's incoming
    gradient) and ``rise_gradients``; by its end, ``gradients`` made in it, and ``left_bytes``: what it made
    that is still alive, besides the next phase's incoming gradient. A storage alive at the highest point, or
    left at the end, that later becomes a weight's gradient (autograd accumulates what an ordinary op made;
    a tied embedding's gradient is held until the embedding's own share is added) moves to the gradient side.
    """

    def __init__(self, live: int, grads: int, extra: int = 0) -> None:
        self.start_live, self.start_grads, self.extra = live, grads, extra
        self.alive: dict[int, int] = {}  # storages made in this phase and not freed: key -> bytes
        self.best = 0  # the highest (live - start) + (gradients made in this phase) so far
        self.best_live, self.best_grads = 0, 0
        self.at_best: dict[int, int] = {}  # what of `alive` was alive then (a gradient-to-be may be among it)
        self.gradients = 0
        self.left: dict[int, int] = {}
        self.left_bytes = 0
        self.ended = False

    @property
    def rise(self) -> int:
        return self.extra + self.best_live

    @property
    def rise_gradients(self) -> int:
        return self.best_grads

    def made(self, key: int, size: int, live: int, grads: int) -> None:
        self.alive[key] = size
        self.note(live, grads)

    def note(self, live: int, grads: int) -> None:
        rise, made = live - self.start_live, grads - self.start_grads
        if rise + made > self.best:
            self.best, self.best_live, self.best_grads, self.at_best = rise + made, rise, made, dict(self.alive)

    def freed(self, key: int) -> None:
        """A storage is gone: it cannot become a gradient any more (its figures stand)."""
        self.alive.pop(key, None)
        self.at_best.pop(key, None)
        self.left.pop(key, None)

    def became_gradient(self, key: int, size: int) -> None:
        # a block's last weight gradients can be accumulated just after the hook that ends its phase
        self.alive.pop(key, None)
        if self.at_best.pop(key, None) is not None:
            self.best_live -= size
            self.best_grads += size
        if self.left.pop(key, None) is not None:
            self.left_bytes -= size
            self.gradients += size

    def end(self, grads: int, incoming: int | None) -> None:
        self.ended = True
        self.gradients = grads - self.start_grads
        self.left = {key: size for key, size in self.alive.items() if key != incoming}
        self.left_bytes = sum(self.left.values())
        self.alive = {}


def _cache_layers(output: Any) -> list[list[Any]]:
    """The tensors of a cache the model returns, per cache layer: whatever the loop's `outputs` keeps alive
    through it until the next forward replaces them.

    transformers' caches keep one layer object per block (`Cache.layers`: keys and values, and whatever else a
    layer keeps: a linear-attention layer's conv and recurrent states, an indexer's keys). An encoder-decoder
    model returns an `EncoderDecoderCache`, which holds two such caches (self-attention and cross-attention, a
    layer of each per decoder block): their layers are joined index by index. A cache laid out otherwise (a
    model's own cache class, the legacy tuple of per-layer tuples) gives what it holds per entry, or all of it
    as one layer."""
    if not isinstance(output, dict):
        return []
    cache = output.get("cache")  # transformers 5.x; `past_key_values` before
    if cache is None:
        cache = output.get("past_key_values")
    if cache is None:
        return []
    if isinstance(cache, (list, tuple)):
        return [list(_tensors_in(layer)) for layer in cache]
    return [layer for layer in _layers_of(cache, depth=0) if layer]


def _layers_of(cache: Any, depth: int) -> list[list[Any]]:
    """Per-layer tensors of a cache object (see `_cache_layers`); its own tensors outside the layers join the first."""
    layers = getattr(cache, "layers", None)
    found = [list(_reachable_tensors(layer)) for layer in layers] if isinstance(layers, (list, tuple)) else []
    rest: list[Any] = []
    for name, value in (vars(cache).items() if hasattr(cache, "__dict__") else ()):
        if name == "layers":
            continue
        if depth < 2 and isinstance(getattr(value, "layers", None), (list, tuple)):
            for index, layer in enumerate(_layers_of(value, depth + 1)):  # a sub-cache: layer by layer
                if index == len(found):
                    found.append([])
                found[index].extend(layer)
        else:
            rest.extend(_reachable_tensors(value))
    if rest:
        found = [rest + found[0], *found[1:]] if found else [rest]
    return found


def _reachable_tensors(value: Any, depth: int = 0) -> Iterator[Any]:
    """Every tensor an object keeps: itself, in its containers, in its attributes (a few levels down; modules and
    classes are not followed)."""
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif depth > 4 or isinstance(value, (str, bytes, type, torch.nn.Module)):
        return
    elif isinstance(value, dict):
        for item in value.values():
            yield from _reachable_tensors(item, depth + 1)
    elif isinstance(value, (list, tuple, set)):
        for item in value:
            yield from _reachable_tensors(item, depth + 1)
    elif hasattr(value, "__dict__") and not callable(value):
        for item in vars(value).values():
            yield from _reachable_tensors(item, depth + 1)


def _unpack(tensor: Any) -> Any:
    return tensor


@contextlib.contextmanager
def _forward_contexts(mode: Any, device_type: str, force_flash: bool, capability: tuple[int, int] | None) -> Iterator[None]:
    """What a second forward of the traced model runs under, as the first did: the fake mode and the stand-ins
    for the target's kernels and for the code fake tensors cannot run."""
    kernels = cuda_kernels(force_flash, capability) if device_type == "cuda" else contextlib.nullcontext(None)
    with mode, _moe_without_grouped_mm(), _unpadded_masks(), _no_layer_dropped(), _deep_copies_clone(), kernels:
        yield


def _forward_once(model: Any, library: str, batch_size: int, seq_len: int | None, image: tuple | None,
                  autocast_dtype: Any) -> None:
    """One training forward, as gradient checkpointing runs it (transformers turns the KV cache off)."""
    import torch

    with _autocast(autocast_dtype):
        if library == "timm":
            model(torch.zeros((batch_size, *image), dtype=_float_dtype(model)))
        else:
            model(**_transformers_inputs(model, batch_size, seq_len, False))


def _checkpointed_rises(model: Any, layers: list[Any], contexts: Any, run: Any) -> dict[int, int]:
    """Per block call: how far live memory rises above the call's start in a checkpointed forward.

    Activation checkpointing runs each block's forward keeping none of its saved tensors (non-reentrant: its
    hooks keep no tensor; reentrant: under no_grad), so a tensor lives while the block's code refers to it:
    what rises is the block's temporaries of the moment and its output, not what it saves. The traced forward
    keeps every saved tensor, so the same model runs a second forward on fake tensors with saved-tensor hooks
    that keep nothing, measured block by block like the first. Empty when there are no blocks or that forward
    cannot run.
    """
    import torch

    if not layers:
        return {}
    meter = _LiveBytes()
    calls: list[int] = []
    current: list[int | None] = [None]

    def enter(module: Any, args: tuple, kwargs: dict) -> None:
        if current[0] is None:  # a block inside a block is part of the outer one, as checkpointing wraps it
            current[0] = len(calls)
            calls.append(id(module))
            meter.open(current[0])

    def leave(module: Any, args: tuple, output: Any) -> None:
        if current[0] is not None and calls[current[0]] == id(module):
            meter.close(current[0])
            current[0] = None

    handles = [layer.register_forward_pre_hook(enter, with_kwargs=True) for layer in layers]
    handles += [layer.register_forward_hook(leave) for layer in layers]
    try:
        with contexts(), meter, torch.autograd.graph.saved_tensors_hooks(_keep_nothing, _unpack):
            run()
    except Exception:  # noqa: BLE001 - the first forward ran; the rule-of-thumb bound stands
        return {}
    finally:
        for handle in handles:
            handle.remove()
    return dict(meter.rises)


def _keep_nothing(tensor: Any) -> None:
    return None


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel()) * tensor.element_size()


def _tensors_in(value: Any) -> Iterator[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)


def _fake_mode_of(model: Any) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor

    for tensor in list(model.parameters()) + list(model.buffers()):
        if isinstance(tensor, FakeTensor):
            return tensor.fake_mode
    raise ValueError("trace_activations needs a model with fake tensors (build.to_fake)")


def _float_dtype(model: Any) -> Any:
    """Images go in in the weights' dtype, as a 16-bit DeepSpeed run must feed them."""
    import torch

    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _absolute_positions(model: Any) -> bool:
    """True when the model has a learned position table (it cannot take longer inputs at all)."""
    import torch

    return any(
        isinstance(module, torch.nn.Embedding) and ("position" in name or name.endswith("wpe"))
        for name, module in model.named_modules()
    )


def _image_size(config: Any) -> tuple[int, int]:
    image = getattr(config, "image_size", 224)
    return tuple(image) if isinstance(image, (list, tuple)) else (image, image)  # type: ignore[return-value]


def _unreached_parameters(model: Any, unreached: set[int], repeats: list[int] | None) -> int:
    """How many trainable parameters got no gradient, counted for the full depth when the trace was shallow
    (every block past the traced ones like the traced block it repeats)."""
    if not unreached:
        return 0
    blocks = checkpoint_layers(model)
    total = sum(p.numel() for p in model.parameters() if id(p) in unreached)
    for j in (repeats or [])[len(blocks):]:
        total += sum(p.numel() for p in blocks[j].parameters() if id(p) in unreached)
    return int(total)


def _forward_peak(forward: _LiveBytes, count: int, repeats: list[int]) -> int:
    """The forward's peak for the whole stack from a shallow trace: block i of the real stack starts where the
    previous one left live memory, rises like the traced block it repeats, and leaves what that block left (its
    saved tensors, its output, and what runs between it and the next block); the head rises above the last."""
    if any(j not in forward.starts or j not in forward.ends for j in range(count)):
        return forward.peak
    start, end = forward.starts, forward.ends
    # what runs between a block and the next: measured after each traced block but the last, which takes the
    # gap before it (the head's own part is in its rise)
    between = [start[j + 1] - end[j] for j in range(count - 1)] + [start[count - 1] - end[count - 2] if count > 1 else 0]
    live, highest = start[0], forward.before_blocks or 0
    for i, j in enumerate(repeats):
        highest = max(highest, live + forward.rises[j])
        live += end[j] - start[j] + (between[j] if i < len(repeats) - 1 else 0)
    return max(highest, live + forward.since_last_end - end[count - 1])


def _repeats(layout: list[int] | None, calls: list[int], blocks: list[Any]) -> list[int] | None:
    """For each block of the real stack, the traced block call whose figures it takes; None when the trace was
    the whole stack.

    Raises:
        NotOneCallPerBlock: the shallow stack's blocks were not each called once, in order.
    """
    if not layout:
        return None
    if calls != [id(block) for block in blocks]:
        raise NotOneCallPerBlock()
    return list(layout)


def _block_parameters(model: Any, calls: list[int], with_backward: set[int]) -> list[int]:
    """Per block call (forward order): the trainable parameters whose gradients that call's backward makes. A
    module called several times has its gradients made by the first of its calls backward reaches, its last
    call with a backward."""
    modules = {id(module): module for module in checkpoint_layers(model)}
    last: dict[int, int] = {}
    for index, key in enumerate(calls):
        if index in with_backward:
            last[key] = index
    counts = [0] * len(calls)
    for key, index in last.items():
        module = modules.get(key)
        if module is not None:
            counts[index] = sum(int(p.numel()) for p in module.parameters() if p.requires_grad)
    return counts


def _takes_use_cache(model: Any) -> bool:
    """Whether the model's forward takes ``use_cache``: by name, or through ``**kwargs`` that a head class hands to
    its base model (transformers 5's causal-LM heads pass what they do not name on to it)."""
    accepts = inspect.signature(model.forward).parameters
    if "use_cache" in accepts:
        return True
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepts.values()):
        return False
    base = getattr(model, getattr(model, "base_model_prefix", "") or "", None)
    return base is not None and base is not model and "use_cache" in inspect.signature(base.forward).parameters


def _transformers_inputs(model: Any, batch_size: int, seq_len: int | None, use_cache: bool | None = None) -> dict[str, Any]:
    """Inputs and labels as a training loop passes them, so the loss is part of the trace (``use_cache=False``:
    as gradient checkpointing runs the forward)."""
    import torch

    config = model.config
    name = type(model).__name__
    accepts = inspect.signature(model.forward).parameters
    single_label = name.endswith(_SINGLE_LABEL_SUFFIXES)
    if model.main_input_name == "pixel_values":
        inputs = {"pixel_values": torch.zeros(batch_size, getattr(config, "num_channels", 3), *_image_size(config),
                                              dtype=_float_dtype(model))}
        if "labels" in accepts and single_label:
            inputs["labels"] = torch.zeros(batch_size, dtype=torch.long)
        return inputs
    frames = mel_frames(model)
    if frames:
        inputs = {"input_features": torch.zeros(batch_size, config.num_mel_bins, frames, dtype=_float_dtype(model))}
    else:
        inputs = {"input_ids": torch.zeros(batch_size, seq_len, dtype=torch.long)}
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in accepts:
        inputs["decoder_input_ids"] = torch.zeros(batch_size, seq_len, dtype=torch.long)
    if "labels" in accepts and not name.endswith("ForQuestionAnswering"):
        shape = (batch_size,) if single_label else (batch_size, seq_len)
        inputs["labels"] = torch.zeros(shape, dtype=torch.long)
    if use_cache is False and _takes_use_cache(model):
        inputs["use_cache"] = False
    return inputs


@contextlib.contextmanager
def _autocast(dtype: Any) -> Iterator[None]:
    import torch

    if dtype is None:
        yield
        return
    with torch.autocast("cpu", dtype=dtype):
        yield


def _param_casts(recorder: _SavedTensorRecorder, params: set[int]) -> Any:
    """Mark the copies autocast makes of weights, so they are counted apart from activations."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    to_copy = torch.ops.aten._to_copy.default

    class _CastWatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            if func is to_copy and args and id(args[0]) in params:
                recorder.casts.add(id(out))
                recorder.keep.append(out)
            return out

    return _CastWatch()


#: transformers' checks whether SDPA may run without a materialized mask (masking_utils): each refuses to read
#: a fake padding mask and keeps the mask, where a real batch without padding would have dropped it
_MASK_SKIP_CHECKS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")
#: transformers' test for several sequences packed in one row (positions that restart), read from the position ids
_PACKING_CHECK = "find_packed_sequence_indices"


@contextlib.contextmanager
def _unpadded_masks() -> Iterator[None]:
    """The traced batch has no padding, so its padding mask is all ones; let transformers' mask-skip checks see that.

    A model that builds a padding mask itself when it is given none (BART's decoder does) hands transformers a
    fake all-ones tensor whose values fake tensors cannot read. transformers then keeps an explicit mask, as it
    must when exporting a graph, where a real batch without padding runs SDPA with ``is_causal`` and no mask
    (and on CUDA may take flash, which refuses masks). For the length of the trace, a fake padding mask is
    passed to these checks as None, which is what an all-ones mask means to them; the rest of each check runs
    as written (sliding windows still keep their mask).

    The same for packing: without a KV cache (gradient checkpointing turns it off) transformers reads the position
    ids to find several sequences packed in one row, and a fake tensor's values cannot say "one sequence", so it
    kept an explicit causal mask that real training does not make. The traced batch holds one sequence a row.
    """
    from torch._subclasses.fake_tensor import FakeTensor

    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    originals = {name: getattr(masking_utils, name) for name in (*_MASK_SKIP_CHECKS, _PACKING_CHECK)
                 if hasattr(masking_utils, name)}

    def unpadded(check: Any) -> Any:
        def call(padding_mask: Any, *args: Any, **kwargs: Any) -> Any:
            return check(None if isinstance(padding_mask, FakeTensor) else padding_mask, *args, **kwargs)
        return call

    def unpacked(find: Any) -> Any:
        def call(position_ids: Any) -> Any:
            return None if isinstance(position_ids, FakeTensor) else find(position_ids)
        return call

    for name, check in originals.items():
        setattr(masking_utils, name, unpacked(check) if name == _PACKING_CHECK else unpadded(check))
    try:
        yield
    finally:
        for name, check in originals.items():
            setattr(masking_utils, name, check)


_DRAWING = threading.local()


@contextlib.contextmanager
def _deep_copies_clone() -> Iterator[None]:
    """A forward that deep-copies tensors (Dory copies its KV-cache layers for each loop) would have torch's
    `Tensor.__deepcopy__` copy a fake tensor's storage bytes, which do not exist: the copy read a bogus pointer and
    the process died of a segmentation fault in its next estimate. For the trace, a deep copy of a leaf fake
    tensor is a clone (a new storage of the same size, all that memory needs); anything else is torch's own."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    own = FakeTensor.__dict__.get("__deepcopy__")

    def deepcopy(self: Any, memo: dict) -> Any:
        if not self.is_leaf or id(self) in memo:
            return torch.Tensor.__deepcopy__(self, memo)  # torch's error for a non-leaf, or the copy made already
        with torch.no_grad():
            copied = self.clone()
        copied.requires_grad_(self.requires_grad)
        memo[id(self)] = copied
        return copied

    FakeTensor.__deepcopy__ = deepcopy
    try:
        yield
    finally:
        if own is None:
            del FakeTensor.__deepcopy__
        else:
            FakeTensor.__deepcopy__ = own


@contextlib.contextmanager
def _no_layer_dropped() -> Iterator[None]:
    """LayerDrop (`if torch.rand([]) < layerdrop: skip the block`, in some 60 transformers models) draws a scalar
    and compares it in Python, which fake tensors cannot do. For the trace, a scalar draw in this thread is the
    largest value `torch.rand` approaches, 1.0, held as a constant fake tensors can compare: no block is dropped,
    the step that holds the most (drops only ever save memory). Draws of any other shape are torch's own."""
    import torch

    original = torch.rand

    def rand(*size: Any, **kwargs: Any) -> Any:
        shape = size[0] if len(size) == 1 and isinstance(size[0], (list, tuple)) else size
        if getattr(_DRAWING, "active", False) and len(shape) == 0 and "out" not in kwargs and "generator" not in kwargs:
            return torch.tensor(1.0, dtype=kwargs.get("dtype") or torch.get_default_dtype())
        return original(*size, **kwargs)

    torch.rand = rand
    _DRAWING.active = True
    try:
        yield
    finally:
        _DRAWING.active = False
        torch.rand = original


@contextlib.contextmanager
def _moe_without_grouped_mm() -> Iterator[None]:
    """transformers' grouped-mm experts path demands bf16 on fake tensors; its fallback op traces in any dtype.

    Both save the same tensors for backward (the routed inputs), so the measurement is the same.
    """
    try:
        from transformers.integrations import moe
    except ImportError:
        yield
        return
    original = getattr(moe, "_can_use_grouped_mm", None)
    if original is None:
        yield
        return
    moe._can_use_grouped_mm = lambda *args, **kwargs: False
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original
