"""Per-device memory for each training layout: plain arithmetic over a `ModelProfile`.

Every figure, with its formula, is in docs/memory.md. Symbols used in the formula strings:
P parameters, S the shard factor (processes sharing one copy), L processes per machine, M machines,
b the bytes of one weight as stored (2 in fp16/bf16 for DeepSpeed, else 4), c the bytes of one
weight while computing (2 with mixed precision, else 4). The ZeRO model-state figures equal
DeepSpeed's own estimators (estimate_zero2/zero3_model_states_mem_needs) for Adam with mixed
precision; tests/memory/test_strategies.py checks that against DeepSpeed itself.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from prefect_accelerate.errors import UsageError
from prefect_accelerate.memory.choices import DEEPSPEED_STRATEGIES, FSDP_STRATEGIES, weight_dtype
from prefect_accelerate.memory.models import (
    ActivationProfile,
    DeviceBreakdown,
    EstimateOptions,
    MemoryItem,
    ModelProfile,
)
from prefect_accelerate.memory.units import human_bytes

#: DeepSpeed's default `reduce_bucket_size` (elements); Accelerate keeps it unless a JSON config says "auto".
#: DeepSpeed allocates the bucket whole, whatever the model's size (`contiguous_gradients`, on by default):
#: ZeRO-1/2 at the start of each backward (deepspeed/runtime/zero/stage_1_and_2.py, `setup_buckets`), ZeRO-3
#: once at start-up (stage3.py, the IPG buffers after `initialize_optimizer_states`), in the weights' dtype.
#: A second one only with `overlap_comm`, which DeepSpeed turns on by default for ZeRO-3 alone, where it adds none.
DS_REDUCE_BUCKET = 500_000_000
#: DeepSpeed's default `stage3_max_reuse_distance` (elements). ZeRO-3 does not release a gathered parameter that
#: comes again within this many parameters of the module order it traced in the first step (partitioned_param_
#: coordinator.py, `__params_to_release`). Forward then backward: a block's weights come again after twice the
#: parameters of the blocks behind it, so from the second step on the last half of this window of blocks stays
#: gathered from its forward to its backward (every weight of a model under about 5e8 parameters).
DS_REUSE_DISTANCE = 1_000_000_000
#: DeepSpeed's default `stage3_prefetch_bucket_size` (elements). ZeRO-3 all-gathers the parameters of the next
#: modules of its trace, up to this many elements, as one coalesced flat buffer (partition_parameters.py
#: `_all_gather_dtype`); when the first of them is needed, `wait` copies every one of them out of it
#: (`AllGatherCoalescedHandle.wait`, a `torch.cat` per parameter), but the handle, and with it the flat buffer,
#: stays in the in-flight registry until the last parameter of that bucket is fetched
#: (partitioned_param_coordinator.py, `_fetch_sub_module_impl`). So while a bucket is being used its weights
#: are held twice: gathered, and in the flat buffer. The prefetch loop stops once it reaches the bucket size,
#: so a bucket can pass it by one parameter; `stage3_max_live_parameters` less what is gathered caps it.
DS_PREFETCH_BUCKET = 50_000_000
#: DeepSpeed's default `stage3_max_live_parameters` (elements).
DS_MAX_LIVE = 1_000_000_000
#: DeepSpeed's default ZeRO-3 `sub_group_size` (elements): the optimizer steps this much at a time.
DS_SUB_GROUP = 1_000_000_000
#: DeepSpeed's estimators budget 1.5x for CPU-side buffers; we use the same factor to agree with them.
DS_CPU_BUFFER_FACTOR = 1.5
#: bitsandbytes' blockwise 8-bit state: one byte per element plus one fp32 scale per 256 elements.
BNB_BYTES_PER_STATE = 1 + 4 / 256


def reduce_bucket_elements(options: EstimateOptions) -> int:
    """ZeRO's `reduce_bucket_size` in elements: the DeepSpeed config's, else DeepSpeed's default ("auto" is filled
    in before the arithmetic; an unfilled one counts as the default)."""
    return options.reduce_bucket_size if isinstance(options.reduce_bucket_size, int) else DS_REDUCE_BUCKET


def overlap_comm_of(options: EstimateOptions) -> bool:
    """DeepSpeed's `overlap_comm` as it runs: the config's, else its default (on for ZeRO-3 only)."""
    return options.overlap_comm if options.overlap_comm is not None else options.strategy == "zero3"


def validate_layout(options: EstimateOptions) -> None:
    """Refuse layouts that no launcher can run, with the reason (one paragraph each)."""
    strategy, offload = options.strategy, options.offload
    if options.num_processes % options.num_machines:
        raise UsageError(
            f"--num_processes {options.num_processes} is not a multiple of --num_machines {options.num_machines}. "
            "As with `accelerate launch`, --num_processes counts the processes on all machines together."
        )
    if strategy == "ddp" and offload != "none":
        raise UsageError(
            f"--offload {offload} needs a sharded strategy: DDP keeps everything on the device. Use "
            "--strategy zero2 or zero3 (DeepSpeed), or fsdp_full_shard with --offload optimizer+params."
        )
    if strategy in ("zero1", "zero2") and offload == "optimizer+params":
        raise UsageError(
            f"DeepSpeed offloads parameters only with ZeRO-3; --strategy {strategy} can offload the optimizer. "
            "Use --strategy zero3 --offload optimizer+params, or --offload optimizer."
        )
    if strategy in FSDP_STRATEGIES and offload == "optimizer":
        raise UsageError(
            "FSDP offloads parameters, gradients and optimizer states together (`fsdp_offload_params`); it has no "
            "optimizer-only offload. Use --offload optimizer+params, or a DeepSpeed strategy for --offload optimizer."
        )


def precision_mode(options: EstimateOptions) -> str:
    """How weights and autocast look during forward for this layout (what the activation trace runs)."""
    mp = options.mixed_precision
    if mp == "no":
        return "fp32"
    if options.strategy in DEEPSPEED_STRATEGIES:
        return mp  # DeepSpeed runs the module in 16-bit, without autocast
    if options.strategy in FSDP_STRATEGIES:
        return f"{mp}+autocast"  # FSDP gathers 16-bit weights; Accelerate also enables autocast
    return f"autocast-{mp}"  # DDP: fp32 weights, autocast casts them per op


def shard_factor(options: EstimateOptions) -> int:
    if options.strategy == "ddp":
        return 1
    if options.strategy == "fsdp_hybrid_shard":
        return options.num_processes // options.num_machines
    return options.num_processes


def _optimizer_state_bytes(profile: ModelProfile, optimizer: str, flat: bool) -> tuple[float, str]:
    """Optimizer state for all trainable parameters (not yet divided by the shard factor)."""
    p = profile.trainable_parameters
    if optimizer in ("adam", "adamw"):
        return 8 * p, "8 B/param (fp32 exp_avg + exp_avg_sq)"
    if optimizer == "sgd":
        return 4 * p, "4 B/param (momentum buffer)"
    if optimizer == "adafactor":
        if flat:
            return 4 * p, "4 B/param (second moment; sharded flat tensors cannot be factored)"
        return 4 * profile.adafactor_state_numel, "4 B x (rows + columns) per matrix (factored second moment)"
    small = 0 if flat else profile.small_tensor_numel
    return (2 * BNB_BYTES_PER_STATE * (p - small) + 8 * small,
            "2 x (1 B + 4 B/256) per param (8-bit blockwise states), 8 B for tensors under 4096 elements")


def _step_temporary(profile: ModelProfile, optimizer: str, local_params: float, device_type: str = "cuda") -> tuple[float, str]:
    if optimizer in ("adam", "adamw") and device_type == "cpu":
        # torch.optim's default (_default_to_fused_or_foreach in torch/optim/optimizer.py): foreach only when every
        # parameter is on a device with foreach kernels (CUDA, XPU), else the per-tensor loop, whose
        # `(exp_avg_sq.sqrt() / bias_correction2_sqrt)` briefly holds two copies of one tensor
        return (8 * min(profile.largest_tensor_numel, local_params),
                "torch's per-tensor Adam step on CPU: 2 fp32 temporaries of the largest tensor")
    if optimizer in ("adam", "adamw"):
        return 4 * local_params, "torch's foreach Adam step: one fp32 temporary per local parameter"
    if optimizer == "adafactor":
        return 8 * profile.largest_tensor_numel, "Adafactor's per-tensor update: 2 fp32 copies of the largest tensor"
    return 0, "updates in place"


class _Layout(NamedTuple):
    """What one strategy keeps: device and CPU items, the optimizer-step temporary and communication buffers."""

    device: list[MemoryItem]
    cpu: list[MemoryItem]
    step: MemoryItem
    communication: MemoryItem
    notes: list[str]


def _ddp(profile: ModelProfile, options: EstimateOptions, opt: tuple[float, str], per_machine: int) -> _Layout:
    p_all, p = profile.parameters, profile.trainable_parameters
    n = options.num_processes
    step, step_formula = _step_temporary(profile, options.optimizer, p, options.device_type)
    return _Layout(
        device=[
            MemoryItem.of("parameters", "Parameters", 4 * p_all + profile.buffer_bytes, "4 B x P fp32 weights (+ buffers)"),
            MemoryItem.of("gradients", "Gradients", 4 * p, "4 B x P fp32"),
            MemoryItem.of("optimizer_states", "Optimizer states", opt[0], opt[1]),
        ],
        cpu=[MemoryItem.of("model_loading", "Model loading", 4 * p_all * per_machine,
                           "each process builds the fp32 model on CPU first: 4 B x P x L")],
        step=MemoryItem.of("step_temporaries", "Optimizer step temporaries", step, step_formula),
        communication=MemoryItem.of("communication_buffers", "Communication buffers", 4 * p if n > 1 else 0,
                                    "DDP gradient buckets: 4 B x P (gradient_as_bucket_view=False)" if n > 1 else "none (one process)"),
        notes=[],
    )


def _deepspeed(profile: ModelProfile, options: EstimateOptions, opt: tuple[float, str], per_machine: int, s: int) -> _Layout:
    p_all, p = profile.parameters, profile.trainable_parameters
    b = 2 if options.mixed_precision != "no" else 4  # bytes of a stored weight
    stage, offload = int(options.strategy[-1]), options.offload
    buffers = profile.buffer_bytes
    if stage == 3 and offload == "optimizer+params":
        params = MemoryItem.of("parameters", "Parameters", buffers, "offloaded to CPU (buffers stay)")
    elif stage == 3:
        params = MemoryItem.of("parameters", "Parameters", b * p_all / s + buffers, f"{b} B x P / S (partitioned)")
    else:
        params = MemoryItem.of("parameters", "Parameters", b * p_all + buffers, f"{b} B x P (every process keeps all weights)")
    if offload != "none":
        grads = MemoryItem.of("gradients", "Gradients", 0, "reduced in buckets and copied to CPU")
        states = MemoryItem.of("optimizer_states", "Optimizer states", 0, "offloaded to CPU")
    else:
        if stage == 1 and zero1_reduces_after_backward(options.strategy, options.offload, options.overlap_comm):
            grads = MemoryItem.of("gradients", "Gradients", b * p,
                                  f"{b} B x P (full gradients, made in backward; after it moved into the reduce bucket "
                                  "and reduced, see the total)")
        elif stage in (1, 2):
            grads = MemoryItem.of("gradients", "Gradients", (b + 4) * p / s,
                                  f"({b} + 4) B x P / S (partitioned; in backward they live in the reduce bucket until "
                                  "a flush, see the total)")
        else:
            # one flat buffer, allocated when ZeRO-3 starts and kept (stage3.py, `grad_partitions_flat_buffer`), in the
            # gradient-accumulation dtype: the weights' unless the config says otherwise; resident (device_breakdown)
            grads = MemoryItem.of("gradients", "Gradients", b * p / s,
                                  f"{b} B x P / S: the flat gradient partition ZeRO-3 allocates at start-up and keeps")
        states = MemoryItem.of("optimizer_states", "Optimizer states", 4 * p / s + opt[0] / s, f"(4 B fp32 master + {opt[1]}) / S")
    device = [params, grads, states]
    if stage == 3:
        device.append(MemoryItem.of("gathered_layers", "Gathered layers", 2 * b * profile.largest_module_parameters,
                                    f"2 x {b} B x the largest module's parameters (weights + gradients while gathered)"))
        # DeepSpeed's own estimator leaves these out; the run holds them (bench/memory_sharded_cpu.py)
        reuse = DS_REUSE_DISTANCE if options.max_reuse_distance is None else options.max_reuse_distance
        kept = min(p_all, reuse // 2 + max(profile.largest_unit_parameters, profile.largest_module_parameters))
        device.append(MemoryItem.of(
            "kept_gathered", "Weights kept gathered", b * max(kept - profile.largest_module_parameters, 0),
            f"{b} B x the blocks within stage3_max_reuse_distance ({reuse:.0e}) of their reuse, gathered from forward "
            f"to backward: min(P, {reuse // 2:.0e} + a block), less the largest module counted above"))
        device.append(_prefetch_buffer(profile, options, b))
    else:
        # reducing a bucket, ZeRO-1/2 flatten its gradient slices into a new tensor first (stage_1_and_2.py
        # `allreduce_and_scatter` -> `allreduce_bucket`: `self.flatten(bucket)`), on every rank, at each flush of
        # the bucket during backward and at its end: a copy of up to one bucket's contents
        size = reduce_bucket_elements(options)
        when = ("after backward" if zero1_reduces_after_backward(options.strategy, offload, options.overlap_comm)
                else "backward")
        device.append(MemoryItem.of(
            "reduction_copy", "Bucket reduction copy", b * min(size, p),
            f"{b} B x min(reduce_bucket_size, P): the flattened copy of a bucket's gradients while it is reduced ({when})"))
    # ZeRO-3 steps one sub-group at a time; a sub-group closes once it reaches sub_group_size, so it can pass it by one
    # weight's partition (stage3.py, `_create_fp16_sub_groups`)
    sub = DS_SUB_GROUP if options.sub_group_size is None else options.sub_group_size
    local = min(p / s, sub + -(-profile.largest_tensor_numel // s)) if stage == 3 else p / s
    step, step_formula = (0, "optimizer runs on CPU") if offload != "none" else _step_temporary(profile, options.optimizer, local)
    if stage == 3 and offload == "none":
        # the step flattens a sub-group's gradient partitions into an fp32 copy for the optimizer (stage3.py,
        # `_prepare_fp32_grad_for_sub_group`), freed after that sub-group's step
        step, step_formula = step + 4 * local, step_formula + " + 4 B x a sub-group's gradients (fp32 copy for the step)"
    notes = ["DeepSpeed keeps 16-bit weights for compute and an fp32 master copy with the optimizer."] if b == 2 else []
    return _Layout(
        device=device,
        cpu=_deepspeed_cpu(profile, stage, offload, per_machine, options.num_processes, options.num_machines),
        step=MemoryItem.of("step_temporaries", "Optimizer step temporaries", step, step_formula),
        communication=_reduce_buckets(options, stage, b),
        notes=notes,
    )


#: DeepSpeed's ZeRO stage -> our strategy name (stage 0 is plain data parallel)
ZERO_STAGE_STRATEGY = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}


def offload_from_devices(param_device: Any, optimizer_device: Any) -> str:
    """Our --offload from DeepSpeed's `offload_param` / `offload_optimizer` devices ("cpu", "nvme", "none", None)."""
    def used(device: Any) -> bool:
        return str(device or "none").lower() not in ("none", "", "auto")

    return "optimizer+params" if used(param_device) else "optimizer" if used(optimizer_device) else "none"


def resident_keys(strategy: str, offload: str) -> tuple[str, ...]:
    """The device items held for the whole step. ZeRO-3 keeps its gradient partition from start-up (without
    offload); every other layout makes its gradients in backward. ZeRO-2 without offload makes its reduce bucket
    at each backward and releases it at the end (`_zero12_phases`); so does ZeRO-1, after the reduction that
    follows backward."""
    keys = ("parameters", "optimizer_states", "gathered_layers", "kept_gathered")
    if strategy == "zero3" and offload == "none":
        return (*keys, "communication_buffers", "gradients")
    return keys if zero_releases_its_bucket(strategy, offload) else (*keys, "communication_buffers")


def zero_releases_its_bucket(strategy: str, offload: str) -> bool:
    """ZeRO-1 and ZeRO-2 without offload (`contiguous_gradients`, DeepSpeed's default): the reduce bucket lives
    through backward (and, for ZeRO-1, the reduction after it) only (see `_zero12_phases`)."""
    return strategy in ("zero1", "zero2") and offload == "none"


def zero1_reduces_after_backward(strategy: str, offload: str, overlap_comm: bool | None) -> bool:
    """ZeRO-1 without offload and without `overlap_comm` (off unless asked for, below ZeRO-3): backward makes
    every gradient whole, as plain data parallelism does; the reduction runs after it (`reduce_gradients`), not in
    backward's hooks."""
    return strategy == "zero1" and offload == "none" and not overlap_comm


def _zero12_phases(profile: ModelProfile, options: EstimateOptions, by_key: dict[str, float]) -> tuple[int, int, int, int]:
    """What ZeRO-1 or ZeRO-2 without offload holds beyond its resident states in backward, at the end of backward,
    and at the optimizer step.

    Read from DeepSpeed 0.19.8's stage_1_and_2.py (`contiguous_gradients`, its default), and seen in the profile of
    a real rank's live blocks at its peak (docs/memory.md, "the real process layouts on families other than Llama"):

    - backward: the reduce bucket(s) are made at the first gradient and released at the end of every backward
      (`_release_ipg_buffers`), so they are held in backward only. Each weight's gradient is copied into the bucket
      and becomes a view of it, so gradients take no room of their own until a flush copies this rank's part out:
      `copy_grads_in_partition` makes the whole partition store (b B x P / S) at the first flush, which comes
      before the end of backward only when the gradients outgrow one bucket (P > reduce_bucket_size). Counted for
      the whole of backward then (it exists from the first flush on).
    - the reduction copy (a bucket's contents, flattened to be reduced): a bucket is flushed when the next gradient
      would overflow it and once more at the end of backward (`independent_gradient_partition_epilogue`), when
      every activation is freed. Gradients that fit one bucket are flushed at that end only, so their copy never
      meets the activations: the end of backward is a moment of its own (the bucket, the copy, the partition store
      if it exists, the loop's outputs).
    - the step: the partition's gradients (b B x P / S) are flattened into one tensor (a second b B x P / S) and
      converted to fp32 for the optimizer (4 B x P / S; no copy when b is 4), then the 16-bit ones are freed and
      the optimizer runs on the fp32 partition with its own temporaries: the larger of the two moments.

    ZeRO-1 with `overlap_comm` reduces in backward's hooks as ZeRO-2 does, with the same memory (the gradients of
    other ranks' partitions stay views into the bucket rather than being dropped). Without it (its default), read
    from the same file and seen in a real rank's live blocks at its peak (docs/memory.md):

    - backward: the bucket is made at the first gradient (`process_gradients` -> `setup_buckets`) and nothing else
      happens in the hooks, so every gradient is made whole (b B x P by backward's end, counted as it grows, as for
      plain data parallelism) beside the bucket.
    - after backward (`reduce_gradients`): each gradient is copied into the bucket and becomes a view of it (its
      own storage freed), a full bucket is flattened and reduced, this rank's part copied into the partition store
      (made at the first flush), and the epilogue releases the bucket and drops the gradients. The first flush's
      copy stands in for the gradients already moved, so this moment holds the bucket and b B x P; from the second
      flush on the store is there too, with one bucket's worth fewer gradients still to move.
    - the step: as ZeRO-2's.
    - when the gradients outgrow one bucket (several flushes a step), some real runs still held one more
      bucket-sized block from the previous step's reduction at the next backward's peak (the old bucket, or a
      flush's flattened copy; 1 of 3 bench runs, with Python's garbage collector on and off): counted in backward
      and after it, as the copy's size.

    Returns what backward holds beyond the activations' phases and the gradients made in it (the bucket; for ZeRO-2
    or overlapped ZeRO-1 when the gradients outgrow one bucket, the partition store and a bucket's copy too,
    counted for the whole of backward: a real rank's first flush came with nearly every activation still alive),
    the step's hold, the end of backward's hold (each beyond the resident states, without the loop's outputs), and
    the reduction copy.
    """
    b = 2 if options.mixed_precision != "no" else 4
    local = profile.trainable_parameters / shard_factor(options)
    size = reduce_bucket_elements(options)
    flushed_early = profile.trainable_parameters > size
    partition = b * local if flushed_early else 0
    copy = by_key.get("reduction_copy", 0)
    bucket = by_key["communication_buffers"]
    step = max(2 * b * local + (4 * local if b != 4 else 0), 4 * local + by_key["step_temporaries"])
    if zero1_reduces_after_backward(options.strategy, options.offload, options.overlap_comm):
        # several flushes a step: one more bucket-sized block from the previous step's reduction (its bucket or a
        # flush's flattened copy) was still alive at the next backward's peak in some real runs, allocated by
        # DeepSpeed in that reduction and, with the garbage collector off, referenced by no Python object after
        # the step (what keeps it was not found); counted, as the lean-safe reading of a timing the estimate
        # cannot know
        lingering = copy if flushed_early else 0
        end = bucket + b * profile.trainable_parameters + max(partition - copy, 0) + lingering
        return round(bucket + lingering), round(step), round(end), round(copy)
    backward = bucket + partition + (copy if flushed_early else 0)
    end = bucket + partition + copy
    return round(backward), round(step), round(end), round(copy)


#: The element counts read from a DeepSpeed config: our option -> (its keys in `zero_optimization`, DeepSpeed's field
#: name and alias (deepspeed/runtime/zero/config.py accepts both), the least value, DeepSpeed's default, whether
#: Accelerate fills in "auto" from the model's hidden size (Accelerator._prepare_deepspeed)).
DS_JSON_ELEMENTS: dict[str, tuple[tuple[str, ...], int, int, bool]] = {
    "reduce_bucket_size": (("reduce_bucket_size",), 1, DS_REDUCE_BUCKET, True),
    "prefetch_bucket_size": (("stage3_prefetch_bucket_size", "prefetch_bucket_size"), 0, DS_PREFETCH_BUCKET, True),
    "max_live_parameters": (("stage3_max_live_parameters", "max_live_parameters"), 0, DS_MAX_LIVE, False),
    "max_reuse_distance": (("stage3_max_reuse_distance", "max_reuse_distance"), 0, DS_REUSE_DISTANCE, False),
    "sub_group_size": (("sub_group_size",), 0, DS_SUB_GROUP, False),
}
#: The EstimateOptions fields a DeepSpeed config sets (besides the stage and offload)
DS_JSON_OPTIONS = (*DS_JSON_ELEMENTS, "overlap_comm", "contiguous_gradients")


def deepspeed_json_settings(path: str) -> dict[str, Any]:
    """What a DeepSpeed JSON config says about the memory layout: ``stage``, ``offload`` (our name), the element
    counts of DS_JSON_ELEMENTS (or "auto" where Accelerate fills them in), ``overlap_comm`` and
    ``contiguous_gradients``; keys it leaves out
    are absent. Raises UsageError naming the file and field."""
    import json

    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except OSError as error:
        raise UsageError(f"Cannot read the DeepSpeed config {path}: {error.strerror or error}. Pass the path of the "
                         "JSON file the launch uses (accelerate config's `deepspeed_config_file`).") from None
    except ValueError as error:
        raise UsageError(f"The DeepSpeed config {path} is not JSON ({error}). Fix the file, or leave "
                         "--deepspeed_config_file out to estimate with DeepSpeed's defaults.") from None
    if not isinstance(config, dict):
        raise UsageError(f"The DeepSpeed config {path} must hold a JSON object (a dict of DeepSpeed's settings), got "
                         f"{type(config).__name__}. Fix the file, as DeepSpeed itself would refuse it.")
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise UsageError(f"`zero_optimization` in the DeepSpeed config {path} must be an object (a JSON dict), got "
                         f"{type(zero).__name__}. Fix the file, as DeepSpeed itself would refuse it.")
    found: dict[str, Any] = {}
    if isinstance(zero.get("stage"), int) and not isinstance(zero.get("stage"), bool):
        found["stage"] = zero["stage"]
    for option, (names, least, default, auto) in DS_JSON_ELEMENTS.items():
        key = next((name for name in names if zero.get(name) is not None), None)
        if key is None:
            continue
        value = zero[key]
        if value == "auto" and auto:
            found[option] = "auto"
        elif (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= least
              and value == int(value)):
            found[option] = int(value)
        else:
            filled = ' or "auto" under Accelerate' if auto else ' (Accelerate does not fill in "auto" here)'
            raise UsageError(f"`zero_optimization.{key}` in the DeepSpeed config {path} is {value!r}: DeepSpeed takes a "
                             f"whole number of elements, at least {least} (its default is {default}){filled}.")
    for switch in ("overlap_comm", "contiguous_gradients"):
        if isinstance(zero.get(switch), bool):
            found[switch] = zero[switch]
    devices = {name: zero[name].get("device") if isinstance(zero.get(name), dict) else None
               for name in ("offload_param", "offload_optimizer")}
    if any(device is not None for device in devices.values()):
        found["offload"] = offload_from_devices(devices["offload_param"], devices["offload_optimizer"])
    return found


def _reduce_buckets(options: EstimateOptions, stage: int, b: int) -> MemoryItem:
    """ZeRO's reduce bucket(s): `reduce_bucket_size` elements of the weights' dtype each, whatever the model's size;
    two for ZeRO-1/2 under `overlap_comm` (stage_1_and_2.py `setup_buckets`), one for ZeRO-3 (stage3.py)."""
    size = reduce_bucket_elements(options)
    count = 2 if overlap_comm_of(options) and stage < 3 else 1
    where = "DeepSpeed's default" if options.reduce_bucket_size is None else "the DeepSpeed config's"
    made = ("made at each backward and released at its end" if zero_releases_its_bucket(options.strategy, options.offload)
            else "allocated whole")
    return MemoryItem.of("communication_buffers", "Communication buffers", count * b * size,
                         f"ZeRO reduce bucket{'s: 2 x' if count == 2 else ':'} {b} B x reduce_bucket_size ({size:,} elements, "
                         f"{where}; {made}){' (overlap_comm)' if count == 2 else ''}")


def _prefetch_buffer(profile: ModelProfile, options: EstimateOptions, b: int) -> MemoryItem:
    """ZeRO-3's in-flight prefetch bucket: a second copy of up to `stage3_prefetch_bucket_size` elements (plus the
    one parameter that passes it) of weights, held with the gathered ones during forward and backward (see
    DS_PREFETCH_BUCKET); none when prefetching is off (0). With the parameters offloaded the buffer is still made on
    the device (each partition is copied up, then gathered)."""
    size = options.prefetch_bucket_size if isinstance(options.prefetch_bucket_size, int) else DS_PREFETCH_BUCKET
    live = DS_MAX_LIVE if options.max_live_parameters is None else options.max_live_parameters
    if size == 0:
        return MemoryItem.of("prefetch_buffer", "Prefetch bucket in flight", 0, "none (stage3_prefetch_bucket_size 0: no prefetch)")
    held = min(profile.parameters, size + profile.largest_tensor_numel, live)
    where = "DeepSpeed's default" if options.prefetch_bucket_size is None else "the DeepSpeed config's"
    return MemoryItem.of(
        "prefetch_buffer", "Prefetch bucket in flight", b * held,
        f"{b} B x min(P, stage3_prefetch_bucket_size ({size:,} elements, {where}) + the largest weight, "
        f"stage3_max_live_parameters): the coalesced all-gather buffer, kept until its last weight is used")


def _fsdp(profile: ModelProfile, options: EstimateOptions, opt: tuple[float, str], per_machine: int, s: int) -> _Layout:
    p_all, p = profile.parameters, profile.trainable_parameters
    c = 2 if options.mixed_precision != "no" else 4  # bytes of a gathered (computing) weight
    units, root = profile.largest_unit_parameters, profile.root_unit_parameters
    notes = []
    if units == 0:
        notes.append("No transformer block class is known for this model (no `_no_split_modules`), so FSDP wraps it as one unit.")
    if options.strategy == "fsdp_hybrid_shard" and options.num_machines == 1:
        notes.append("HYBRID_SHARD on one machine shards like FULL_SHARD.")
    cpu = [MemoryItem.of("model_loading", "Model loading", 4 * p_all, "rank 0 builds the fp32 model on CPU (cpu_ram_efficient_loading)")]
    if options.offload == "none":
        device = [
            MemoryItem.of("parameters", "Parameters", 4 * p_all / s + profile.buffer_bytes, "4 B x P / S fp32 shards"),
            MemoryItem.of("gradients", "Gradients", 4 * p / s, "4 B x P / S fp32 shards"),
            MemoryItem.of("optimizer_states", "Optimizer states", opt[0] / s, f"({opt[1]}) / S"),
        ]
        step, step_formula = _step_temporary(profile, options.optimizer, p / s)
    else:
        device = [
            MemoryItem.of("parameters", "Parameters", profile.buffer_bytes, "shards offloaded to CPU (buffers stay)"),
            MemoryItem.of("gradients", "Gradients", 0, "shards offloaded to CPU"),
            MemoryItem.of("optimizer_states", "Optimizer states", 0, "offloaded to CPU, step runs there"),
        ]
        step, step_formula = 0, "optimizer runs on CPU"
        cpu.append(MemoryItem.of("offloaded_states", "Offloaded shards", (8 * p + opt[0]) * per_machine / s,
                                 "(4 B params + 4 B grads + optimizer states) x P / S x L"))
    if options.strategy == "fsdp_shard_grad_op":
        gathered = c * p_all + c * max(units, root)
        formula = f"{c} B x P (weights stay gathered from forward to backward) + {c} B x the largest unit's gradients"
    else:
        gathered = c * (root + 2 * units) + c * max(units, root)
        formula = f"{c} B x (root unit + 2 x largest block: current + prefetched) + {c} B x the largest unit's gradients"
    device.append(MemoryItem.of("gathered_layers", "Gathered layers", gathered, formula))
    return _Layout(device=device, cpu=cpu,
                   step=MemoryItem.of("step_temporaries", "Optimizer step temporaries", step, step_formula),
                   communication=MemoryItem.of("communication_buffers", "Communication buffers", 0, "none beyond gathered layers"),
                   notes=notes)


def device_breakdown(profile: ModelProfile, options: EstimateOptions) -> DeviceBreakdown:
    """The per-device (and per-machine CPU) memory of one layout. Pure arithmetic; no torch."""
    if options.strategy is None:
        raise UsageError("A per-device breakdown needs a strategy (ddp, zero1..zero3, fsdp_*).")
    validate_layout(options)
    strategy = options.strategy
    n, m = options.num_processes, options.num_machines
    per_machine = n // m
    s = shard_factor(options)
    mp = options.mixed_precision != "no"
    unreached_note = None
    acts = profile.activations
    if strategy == "ddp" and n == 1 and acts is not None and acts.unreached_parameters and profile.trainable_parameters:
        # one process runs without a DDP wrapper: a parameter the loss never reaches keeps .grad None, and
        # torch.optim makes no state for it (a DDP wrapper over several processes buckets every parameter)
        unreached = min(acts.unreached_parameters, profile.trainable_parameters)
        profile = profile.model_copy(update={"trainable_parameters": profile.trainable_parameters - unreached})
        unreached_note = (f"{unreached:,} trainable parameters get no gradient from the loss (measured by backward on "
                          "the fake graph): no gradient and no optimizer state are counted for them.")
    opt = _optimizer_state_bytes(profile, options.optimizer, flat=strategy != "ddp")
    if strategy == "ddp":
        layout = _ddp(profile, options, opt, per_machine)
    elif strategy in DEEPSPEED_STRATEGIES:
        layout = _deepspeed(profile, options, opt, per_machine, s)
    else:
        layout = _fsdp(profile, options, opt, per_machine, s)
    device, cpu, notes = list(layout.device), list(layout.cpu), list(layout.notes)
    if unreached_note:
        notes.append(unreached_note)

    # DDP and ZeRO-1 reducing after backward make each weight's whole gradient while the activations are alive
    after_backward = zero1_reduces_after_backward(strategy, options.offload, options.overlap_comm)
    whole = strategy == "ddp" or after_backward
    activation_item, backward, backward_formula, act_notes, method = _activation_items(
        profile.activations, options, strategy == "ddp" and mp, whole_gradients=whole)
    if whole and method == "traced" and not profile.activations.head_backward_measured:
        # the first gradients (head / embedding) appear while every activation is still alive
        width = 4 if strategy == "ddp" or not mp else 2
        backward += width * profile.largest_tensor_numel
        backward_formula += f" + {width} B x the largest weight (its gradient comes first)"
    notes.extend(act_notes)
    device.append(activation_item)
    device.append(MemoryItem.of("backward_temporaries", "Backward temporaries", backward, backward_formula))
    device.extend([layout.step, layout.communication])
    device.append(_loop_outputs(profile.activations, options))

    by_key = {item.key: item.bytes for item in device}
    # ZeRO-3 keeps its gradient partitions from start-up; every other layout makes its gradients in backward
    held = resident_keys(strategy, options.offload)
    resident = sum(by_key.get(k, 0) for k in held)
    made_gradients = 0 if "gradients" in held else by_key["gradients"]
    # ZeRO-3's prefetch bucket lives through forward and backward, ZeRO-1/2's reduction copy through backward; neither
    # at the optimizer step
    in_flight, reducing = by_key.get("prefetch_buffer", 0), by_key.get("reduction_copy", 0)
    step = made_gradients + by_key["step_temporaries"] + by_key["loop_outputs"]
    end_of_backward = 0
    if zero_releases_its_bucket(strategy, options.offload):
        # its bucket and, past the first flush, its gradient partition through backward (ZeRO-1 by default: the bucket
        # beside whole gradients, reduced after backward); the step on its own terms
        in_backward, step_hold, end, copy = _zero12_phases(profile, options, by_key)
        reducing = reducing - copy + in_backward
        made_gradients = made_gradients if after_backward else 0
        step = step_hold + by_key["loop_outputs"]
        end_of_backward = end + by_key["loop_outputs"]
    forward_backward = by_key["activations"] + by_key["backward_temporaries"] + in_flight + reducing
    last_block, where = _block_phases(profile, options, made_gradients, keeps_casts=strategy == "ddp" and mp)
    last_block += in_flight + reducing
    if last_block > max(forward_backward, end_of_backward):
        blocks = len(profile.activations.per_layer_bytes)
        held = "recomputed" if options.gradient_checkpointing else "its saved tensors"
        if where == 0:
            notes.append(f"The peak of backward comes at its end: the first block ({held}) with the gradients of the "
                         f"blocks after it already made ({human_bytes(last_block)} besides the resident states).")
        else:
            notes.append(f"The peak of backward comes in the backward of block {where + 1} of {blocks} ({held}), with "
                         f"the saved tensors of the blocks before it and the gradients of those after it "
                         f"({human_bytes(last_block)} besides the resident states).")
    forward = _forward_phase(profile.activations, options) + by_key["loop_outputs"] + in_flight
    if end_of_backward > max(forward_backward, last_block, step, forward):
        if after_backward:
            notes.append(f"The peak comes after backward, when ZeRO-1 moves the whole gradients into its bucket and reduces "
                         f"them ({human_bytes(end_of_backward)} besides the resident states).")
        else:
            notes.append(f"The peak comes at the end of backward, when {strategy.upper().replace('ZERO', 'ZeRO')} reduces "
                         f"its last bucket: the bucket and its flattened copy ({human_bytes(end_of_backward)} besides the "
                         "resident states).")
    if forward > max(forward_backward, last_block, step, end_of_backward):
        notes.append(f"The peak comes during the forward: its temporaries of the moment outgrow what backward holds "
                     f"({human_bytes(forward)} besides the resident states, the previous step's outputs included).")
    total = resident + max(forward_backward, last_block, step, forward, end_of_backward)
    states = sum(by_key.get(k, 0) for k in ("parameters", "gradients", "optimizer_states", "gathered_layers"))
    cpu_total = sum(item.bytes for item in cpu)
    if mp and strategy not in DEEPSPEED_STRATEGIES:
        notes.append("Mixed precision here keeps fp32 weights as the master copy (no separate master weights).")
    return DeviceBreakdown(
        strategy=strategy, world_size=n, num_machines=m, processes_per_machine=per_machine, shard_factor=s,
        mixed_precision=options.mixed_precision, optimizer=options.optimizer, offload=options.offload,
        overlap_comm=overlap_comm_of(options) if strategy in DEEPSPEED_STRATEGIES else None,
        gradient_checkpointing=options.gradient_checkpointing,
        batch_size=options.batch_size,
        seq_len=profile.activations.seq_len if profile.activations else options.seq_len,
        trained_class=profile.trained_class, parameters=profile.parameters,
        device_items=device, device_total_bytes=total, device_total=human_bytes(total),
        all_items_bytes=sum(by_key.values()) - by_key["loop_outputs"],  # already inside the activations
        model_states_bytes=states,
        cpu_items=cpu, cpu_per_machine_bytes=cpu_total, cpu_per_machine=human_bytes(cpu_total),
        activations_method=method, attention=_attention_label(profile.activations, options.device_type), notes=notes,
    )


def _forward_phase(acts: ActivationProfile | None, options: EstimateOptions) -> float:
    """The most the forward holds at once, measured on the fake tensors: everything it has saved by then plus the
    temporaries of that moment (a model whose forward makes large transient tensors, such as a state-space scan
    written in plain torch, peaks here rather than in backward). Under checkpointing a block keeps none of its
    saved tensors, so at block k the forward holds what was saved outside the blocks before it, the inputs kept
    of blocks 0..k, what the model still holds of the previous block's outputs (Bloom's stack keeps the attention
    probabilities a block returns until the next block returns) and block k's rise in a forward that keeps no
    saved tensor (measured by a second fake forward); a profile without those rises takes one block's traced
    rise, saved tensors included, over every kept input. 0 when the forward was not measured."""
    if acts is None or acts.method != "traced" or not acts.forward_measured:
        return 0
    scale = options.batch_size / acts.batch_size
    blocks = len(acts.per_layer_bytes)
    if options.gradient_checkpointing and blocks and len(acts.block_checkpointed_rises) == blocks \
            and len(acts.block_input_bytes) == blocks and len(acts.outside_gap_bytes) == blocks + 1:
        # block by block: what forward saved outside the blocks before it (an encoder-decoder saves between its
        # stacks), the inputs checkpointing kept of it and of every block before it, what the model still holds
        # of the previous block's outputs, and its own rise in a forward that keeps no saved tensor
        carries = acts.block_carry_bytes if len(acts.block_carry_bytes) == blocks else [0] * blocks
        outside = kept = worst = 0
        for k in range(blocks):
            outside += acts.outside_gap_bytes[k]
            kept += acts.block_input_bytes[k]
            worst = max(worst, outside + kept + carries[k] + acts.block_checkpointed_rises[k])
        return round(worst * scale)
    if options.gradient_checkpointing and acts.per_layer_bytes:
        before = acts.outside_layers_bytes - acts.outside_after_layers_bytes
        carry = max(acts.block_carry_bytes, default=0)
        return round((before + acts.layer_input_bytes + acts.block_forward_rise_bytes + carry) * scale)
    return round(acts.forward_peak_bytes * scale)


def _block_backward(acts: ActivationProfile) -> int:
    """What one block holds at the worst moment of its own backward: measured by a backward on the fake tensors
    when it ran (never capped: a block's own backward code can make more temporaries than any rule assumes),
    else the forward's figure, at most every saved tensor plus two of the largest."""
    if acts.block_backward_measured and acts.block_backward_peak_bytes:
        return acts.block_backward_peak_bytes
    bound = max(acts.per_layer_bytes) + 2 * acts.largest_layer_tensor_bytes
    return min(acts.block_backward_peak_bytes, bound) if acts.block_backward_peak_bytes else bound


def _measured_blocks(acts: ActivationProfile | None) -> bool:
    """Whether backward was measured block by block (`_block_phases` can follow it one block at a time)."""
    if acts is None or acts.method != "traced" or not acts.per_layer_bytes or not acts.head_backward_measured:
        return False
    blocks = len(acts.per_layer_bytes)
    return all(len(figures) == blocks for figures in (acts.block_backward_peaks, acts.block_backward_gradient_bytes,
                                                       acts.block_parameters, acts.block_input_bytes,
                                                       acts.block_recompute_peaks)) \
        and len(acts.outside_gap_bytes) == blocks + 1


def _block_phases(profile: ModelProfile, options: EstimateOptions, gradients: float,
                  keeps_casts: bool = False) -> tuple[float, int]:
    """The most backward holds while it runs one block, and which block (0: the first, backward's last step).

    Backward runs the blocks last to first. While it runs block k it holds: what forward saved outside the
    blocks before block k (before the first block; an encoder-decoder's encoder norm and decoder embeddings,
    between its stacks), the loop's outputs and what the head left alive; the saved tensors of blocks 0..k-1
    (under checkpointing, the kept inputs of blocks 0..k instead, and block k recomputed: the larger of its
    recomputing forward's highest point and its backward's); block k at the highest point of its own
    backward (measured on the fake graph: its saved tensors, its activations' rise, and the weights' gradients
    it had made by then); and the gradients of the head and of every block after k, already made. Each of
    these is measured per block, so a model whose blocks differ (a hybrid of attention and state-space or
    linear-attention blocks, a stack of experts and dense blocks) is followed block by block: the heaviest
    block's backward is not assumed to come first, nor last. Activations scale with the batch; gradients do
    not, and are sharded as the layout shards them (``gradients``: the layout's gradient bytes).
    What the backward of later blocks left waiting when block k's began is held too (the summed gradient of a
    tensor several blocks take, T5's position bias, an encoder's output: `block_backward_waiting_bytes`).
    ``keeps_casts`` (DDP with autocast): the 16-bit weight copies the blocks saved are held too, those of
    blocks 0..k (of block k alone under checkpointing, which recomputes them), and those outside the blocks.

    Without per-block figures (backward not measured), the bound of `_last_block_phase`.
    """
    acts = profile.activations
    if acts is None or acts.method != "traced" or not acts.per_layer_bytes or profile.trainable_parameters <= 0:
        return 0, -1
    if not _measured_blocks(acts):
        return _last_block_phase(profile, options, gradients), 0
    scale = options.batch_size / acts.batch_size
    per_parameter = gradients / profile.trainable_parameters  # a gradient's bytes per parameter in this layout
    element = 4 if weight_dtype(acts.precision_mode) == "float32" else 2  # bytes of the fake weights' dtype
    checkpointed = options.gradient_checkpointing
    base = acts.retained_output_bytes + acts.head_left_bytes + (0 if checkpointed else acts.cache_unsaved_bytes)
    # saved outside the blocks before block k: alive while block k's backward runs
    outside_before = [sum(acts.outside_gap_bytes[:k + 1]) for k in range(len(acts.per_layer_bytes))]
    made = acts.head_gradient_bytes / element  # parameters whose gradients are made when block k's backward runs
    earlier_saved = sum(acts.per_layer_bytes)
    kept_inputs = sum(acts.block_input_bytes)
    casts = list(acts.block_cast_bytes) if keeps_casts and len(acts.block_cast_bytes) == len(acts.per_layer_bytes) else []
    earlier_casts = sum(casts)
    cast_outside = max(acts.autocast_weight_copy_bytes - earlier_casts, 0) if keeps_casts else 0
    # what the backward of later blocks left waiting when block k's began (an older profile has none)
    waiting = acts.block_backward_waiting_bytes if len(acts.block_backward_waiting_bytes) == len(acts.per_layer_bytes) \
        else [0] * len(acts.per_layer_bytes)
    best, where = 0.0, -1
    for k in reversed(range(len(acts.per_layer_bytes))):
        earlier_saved -= acts.per_layer_bytes[k]
        own = per_parameter * acts.block_backward_gradient_bytes[k] / element  # its gradients made by its highest point
        if checkpointed:
            # its input is kept by checkpointing; the recomputed block does not hold a second copy of it. Its
            # recomputing forward comes first, before any of its own gradients are made
            block = max(max(acts.block_backward_peaks[k] - acts.block_saved_input_bytes, 0) * scale + own,
                        acts.block_recompute_peaks[k] * scale)
            held = (base + outside_before[k] + kept_inputs) * scale + block
        else:
            held = (base + outside_before[k] + earlier_saved + acts.block_backward_peaks[k]) * scale + own
        if casts:
            copies = cast_outside + (casts[k] if checkpointed else earlier_casts)
            earlier_casts -= casts[k]
        else:
            copies = acts.autocast_weight_copy_bytes if keeps_casts else 0
        value = held + waiting[k] * scale + per_parameter * min(made, profile.trainable_parameters) + copies
        if value > best:
            best, where = value, k
        made += acts.block_parameters[k]
        kept_inputs -= acts.block_input_bytes[k]
    return int(best), where


def _last_block_phase(profile: ModelProfile, options: EstimateOptions, gradients: float) -> float:
    """What backward holds while it runs the first block, its last step: the tensors saved before the blocks,
    the first block's own (recomputed under checkpointing) and the loop's outputs, that block's temporaries,
    and the gradients of every parameter but that block's, which backward has already made.

    Backward frees each block's saved tensors as it makes that block's gradients, so what it holds moves
    linearly from its start (every activation, the head's gradients: the activations item) to this end;
    the peak is at one of the two. Activations dwarf gradients in the usual case, but with checkpointing,
    small batches or short sequences the end is the larger: gradients accumulate, activations do not.
    """
    acts = profile.activations
    if acts is None or acts.method != "traced" or not acts.per_layer_bytes or profile.trainable_parameters <= 0:
        return 0
    scale = options.batch_size / acts.batch_size
    blocks = len(acts.per_layer_bytes)
    before = acts.outside_layers_bytes - acts.outside_after_layers_bytes
    first_block = _block_backward(acts)
    if options.gradient_checkpointing:
        # its input is kept by checkpointing; the recomputed block does not hold a second copy of it
        first_block += max(acts.layer_input_bytes / blocks - acts.block_saved_input_bytes, 0)
    held = (before + acts.retained_output_bytes + first_block) * scale
    made = gradients * max(profile.trainable_parameters - profile.largest_unit_parameters, 0) / profile.trainable_parameters
    return int(held + made)


def _attention_label(acts: ActivationProfile | None, device_type: str) -> str:
    """What attention the activations assume, in words: 'sdpa (CUDA kernel: flash)', 'eager'."""
    if acts is None or acts.method != "traced":
        return ""
    label = acts.attention_implementation or ""
    if acts.attention_kernels and acts.attention_implementation != "flash_attention_2":
        label += f" (CUDA kernel: {', '.join(acts.attention_kernels)})"
    elif not acts.attention_kernels and label == "sdpa":
        # for a CUDA target, a traced forward that made no SDPA call (a stack of Mamba or linear-attention blocks)
        label += " (CPU kernels)" if device_type == "cpu" else " (no SDPA call in the traced forward)"
    return label.strip()


def _loop_outputs(acts: ActivationProfile | None, options: EstimateOptions) -> MemoryItem:
    """The training loop's `outputs` (logits, a KV cache) stay alive through the optimizer step."""
    if acts is None or acts.method != "traced":
        return MemoryItem.of("loop_outputs", "Outputs kept through the step", 0, "not estimated")
    scale = options.batch_size / acts.batch_size
    # transformers turns the cache off under gradient checkpointing
    cache = 0 if options.gradient_checkpointing else acts.cache_bytes
    formula = "the model's outputs (logits" + (", KV cache)" if cache else ")")
    formula += " held by the loop's `outputs` until the next forward replaces them (counted with the step only)"
    return MemoryItem.of("loop_outputs", "Outputs kept through the step", (acts.retained_output_bytes + cache) * scale, formula)


def _deepspeed_cpu(profile: ModelProfile, stage: int, offload: str, per_machine: int, n: int, m: int) -> list[MemoryItem]:
    """DeepSpeed's own CPU budget per machine (its estimators, zero_init=True for ZeRO-3)."""
    p = profile.trainable_parameters
    f = DS_CPU_BUFFER_FACTOR
    if stage in (1, 2):
        if offload == "none":
            return [MemoryItem.of("model_loading", "Model loading", 4 * p * per_machine * f,
                                  "4 B x P x L x 1.5 (each process loads the fp32 model; DeepSpeed's estimator)")]
        return [MemoryItem.of("offloaded_states", "Offloaded optimizer", p * max(4 * n, 16) * f,
                              "P x max(4 x processes, 16) x 1.5 (DeepSpeed's estimator)")]
    if offload == "none":
        return [MemoryItem.of("model_loading", "Model loading", 4 * profile.largest_module_parameters * per_machine * f,
                              "4 B x largest module x L x 1.5 (zero.Init builds layer by layer; DeepSpeed's estimator)")]
    per_param = 18 if offload == "optimizer+params" else 16
    return [MemoryItem.of("offloaded_states", "Offloaded states", p * per_param / m * f,
                          f"{per_param} B x P / M x 1.5 (DeepSpeed's estimator)")]


def _activation_items(acts: ActivationProfile | None, options: EstimateOptions, keeps_casts: bool,
                      whole_gradients: bool = False) -> tuple[MemoryItem, int, str, list[str], str]:
    """Activations for this batch, and the backward temporaries (plus DDP's autocast weight copies).

    ``whole_gradients``: each process keeps every weight's whole gradient (DDP), so the gradients the head's
    phase of backward makes (measured on the fake graph, not scaled with the batch) are held on top of the
    activations from then on."""
    if acts is None or acts.method != "traced":
        note = acts.note if acts is not None and acts.note else "Activations are not counted (no trace was run)."
        return MemoryItem.of("activations", "Activations", 0, "not estimated"), 0, "not estimated", [note], "not estimated"
    scale = options.batch_size / acts.batch_size
    notes = [acts.note] if acts.note else []
    head_rise = acts.head_backward_bytes if acts.head_backward_measured else 2 * acts.largest_tensor_bytes
    head_grads_at_rise = acts.head_backward_gradient_bytes if whole_gradients else 0
    head_grads = acts.head_gradient_bytes if whole_gradients else 0
    by_block = _measured_blocks(acts)
    if by_block:
        # backward's start: the loss and the head; each block's phase is `_block_phases`
        backward = acts.head_backward_bytes * scale + head_grads_at_rise
        backward_formula = ("measured on the fake graph: the most the loss and the head add to what forward saved, with "
                            "the weights' gradients made by then (the blocks' phases are followed one by one)")
    elif acts.head_backward_measured:
        # backward's start (the loss, the head), or the last block's backward once the head's saved tensors are
        # freed (what the head made and left alive, and its weights' gradients, still held)
        backward = max(acts.head_backward_bytes * scale + head_grads_at_rise,
                       (acts.block_backward_rise_bytes + acts.head_left_bytes - acts.outside_after_layers_bytes) * scale
                       + head_grads, 0)
        backward_formula = ("measured on the fake graph: the most backward adds to what forward saved, at its start (the "
                            "loss and the head, with the weights' gradients made by then) or in the last block once the "
                            "head's tensors are freed")
    else:
        backward = 2 * acts.largest_tensor_bytes * scale
        backward_formula = "2 x the largest activation (its gradient and the next one)"
    if options.gradient_checkpointing and acts.per_layer_bytes:
        # torch.utils.checkpoint (transformers: use_reentrant=False) keeps each block's inputs. Backward has two
        # phases that never overlap: the head's (what it saved, its gradients) and then each block's (the block
        # recomputed, its gradients); the head's saved tensors are freed before the first block is recomputed.
        before = acts.outside_layers_bytes - acts.outside_after_layers_bytes
        head = acts.outside_after_layers_bytes + head_rise
        block = 0 if by_block else _block_backward(acts)  # measured block by block: each is a phase of its own
        phase = "what the head saves" if head >= block else "one block recomputed"
        # a recomputed block makes again what it saved, except its own inputs: those are the kept block inputs
        kept = before + acts.layer_input_bytes + acts.retained_output_bytes + (
            acts.outside_after_layers_bytes if head >= block else max(acts.per_layer_bytes) - acts.block_saved_input_bytes)
        if head < block:
            backward = max(block - max(acts.per_layer_bytes) + acts.head_left_bytes, 0) * scale + head_grads
            backward_formula = ("a block's backward beyond what it saved, measured on the fake graph" if acts.block_backward_measured
                                else "a block's backward at its worst op: 2 x that op's saved tensor (its gradient and the next "
                                "one), less what the block saved after it, already freed")
        formula = (f"traced for {acts.input_description}, checkpointed: saved before the blocks + {len(acts.per_layer_bytes)} "
                   f"block inputs + outputs + {phase}" + ("" if by_block else " (the larger backward phase: the head's, or one block's)"))
    else:
        kept = acts.saved_bytes + acts.retained_output_bytes + acts.cache_unsaved_bytes
        formula = f"traced for {acts.input_description}: tensors saved for backward + outputs"
        if acts.cache_unsaved_bytes:
            formula += f" + KV cache entries not saved for backward ({human_bytes(acts.cache_unsaved_bytes)})"
        if options.gradient_checkpointing:
            notes.append("Gradient checkpointing is not modelled for this model (no checkpointable blocks found); "
                         "activations are counted in full.")
    if scale != 1:
        formula += f", scaled x{scale:g} to batch {options.batch_size}"
    if acts.attention_backward_bytes:
        backward += acts.attention_backward_bytes * scale
        backward_formula += (f" + the attention mask's gradient that memory-efficient backward materializes "
                             f"({human_bytes(acts.attention_backward_bytes * scale)})")
    if keeps_casts and acts.autocast_weight_copy_bytes:
        backward += acts.autocast_weight_copy_bytes
        backward_formula += f" + autocast's 16-bit weight copies kept for backward ({human_bytes(acts.autocast_weight_copy_bytes)})"
    return MemoryItem.of("activations", "Activations", kept * scale, formula), int(backward), backward_formula, notes, "traced"
