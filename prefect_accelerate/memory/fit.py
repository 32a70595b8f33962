"""Will it fit? A verdict with headroom, and the smallest change that makes it fit when it does not.

The estimate's per-device total is the peak of live tensors (what `torch.cuda.max_memory_allocated`
reports). A CUDA device needs more: the context and library workspaces outside PyTorch's allocator,
and what the caching allocator holds beyond live tensors (rounding, fragmentation). The verdict adds
both (`allocator_overhead`) and compares the sum with the device: "fits", "at risk" (less than 5% of
the device left) or "does not fit".
Suggestions are computed, not guessed: each candidate change is a new `EstimateOptions` run through
the same arithmetic (`device_breakdown`) over the profile already measured, so no model is rebuilt.
"""

from __future__ import annotations

import itertools

from prefect_accelerate.errors import EstimateError, UsageError
from prefect_accelerate.memory.choices import DEFAULT_RESERVE_FRACTION, DEEPSPEED_STRATEGIES, FSDP_STRATEGIES, UNKNOWN_AUTOCAST
from prefect_accelerate.memory.models import EstimateOptions, FitVerdict, MeasuredPeak, MemoryEstimate, ModelProfile, Suggestion
from prefect_accelerate.memory.strategies import device_breakdown
from prefect_accelerate.memory.units import human_bytes, parse_memory_size

MAX_PROCESSES_PER_MACHINE = 16
MAX_SUGGESTIONS = 5
#: A run leaving less than this share of the device free is "at risk", not "fits".
AT_RISK_FRACTION = 0.05
#: Where the estimate meets a path it does not model (custom attention, remote code, an untraced forward), a
#: run must leave this share of the device free to be called "fits"; under it the verdict is "at risk".
UNMODELLED_MARGIN = 0.15
#: Attention implementations whose kernels the trace stands in for (memory/attention.py).
MODELLED_ATTENTION = ("eager", "sdpa", "flash_attention_2")
#: Device memory outside PyTorch's caching allocator: CUDA context, loaded kernels, cuBLAS/cuDNN handles.
#: On the H200 of issue #16 (torch 2.11, CUDA 13): 139.80 GiB total, 138.93 GiB reserved by PyTorch at
#: the out-of-memory error, so 0.87 GiB outside it; rounded up for the handles a multi-GPU run adds.
CUDA_CONTEXT_BYTES = 1 << 30
#: What the caching allocator reserves beyond live tensors, as a share of the allocated peak: blocks
#: rounded up, and freed blocks that stay split inside their segments (it never merges segments; it
#: releases only wholly free ones before reporting out-of-memory). Measured once: 9.60 GiB reserved but
#: unallocated at 129.33 GiB allocated when the Llama-2-7B-shaped run failed (7.4%).
ALLOCATOR_FRAGMENTATION = 0.075


def detect_device_memory() -> tuple[int, str]:
    """The smallest total memory among this machine's CUDA devices, and a description of them.

    Raises:
        EstimateError: there is no CUDA device here (then pass ``--device_memory``).
    """
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None
    if torch is None or not torch.cuda.is_available():
        raise EstimateError(
            "A fit verdict needs the memory of one training device, and this machine has no CUDA device to ask. "
            "Pass it with `--device_memory 80GiB` (Python: check_fit(estimate, '80GiB'))."
        )
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    smallest = min(props, key=lambda p: p.total_memory)
    names = sorted({p.name for p in props})
    return int(smallest.total_memory), f"detected: {len(props)} x {', '.join(names)} ({human_bytes(smallest.total_memory)} each)"


def allocator_overhead(allocated_peak: int) -> tuple[int, str]:
    """What a CUDA device needs beyond the allocated peak, and the explanation printed with the verdict.

    Two terms (docs/memory.md, "Fit verdict"): memory outside PyTorch's allocator (the CUDA context,
    kernel images, cuBLAS/cuDNN handles), a constant; and what the caching allocator holds beyond live
    tensors (sizes rounded to 512 B, 2 MiB segments for requests under 1 MiB, 20 MiB for 1-10 MiB, and
    freed blocks that stay split inside their segments: fragmentation), a share of the peak.
    """
    fragmentation = int(allocated_peak * ALLOCATOR_FRAGMENTATION)
    text = (f"CUDA context and library workspaces {human_bytes(CUDA_CONTEXT_BYTES)} + caching-allocator rounding and "
            f"fragmentation {ALLOCATOR_FRAGMENTATION:.1%} of the {human_bytes(allocated_peak)} allocated peak "
            f"({human_bytes(fragmentation)})")
    return CUDA_CONTEXT_BYTES + fragmentation, text


def check_fit(estimate: MemoryEstimate, device_memory: str | int | None = None,
              reserve_fraction: float = DEFAULT_RESERVE_FRACTION) -> FitVerdict:
    """Compare what the CUDA allocator will need for an estimate with one device's memory.

    Args:
        estimate: a MemoryEstimate with a breakdown (made with a strategy).
        device_memory: ``"80GiB"``, ``"80GB"``, bytes, or None to use the smallest CUDA device here.
        reserve_fraction: an extra share of the device to keep back, on top of the modelled CUDA context
            and allocator overhead (0 by default).

    Returns:
        A FitVerdict: ``status`` "fits" (``fits`` True), "at risk" (it needs less than the device but
        leaves under 5% of it free) or "does not fit"; unless it fits, ``suggestions`` lists changes that
        bring it under the at-risk line, the smallest change first.

    Raises:
        EstimateError: no breakdown to compare, or no device memory given and none detected.
    """
    if estimate.breakdown is None or estimate.profile is None:
        raise EstimateError(
            f"The estimate for `{estimate.model}` has no per-device breakdown, so there is nothing to compare with "
            "device memory. Estimate with a strategy (`--strategy ddp`, or EstimateOptions(strategy='ddp'))."
        )
    if not 0 <= reserve_fraction < 1:
        raise UsageError(f"The reserve must be a fraction between 0 and 1, got {reserve_fraction}.")
    if device_memory is None:
        memory, where = detect_device_memory()
    else:
        memory, where = parse_memory_size(device_memory), "given"
    usable = int(memory * (1 - reserve_fraction))
    breakdown = estimate.breakdown
    allocated = breakdown.device_total_bytes
    overhead, explained = allocator_overhead(allocated)
    required = allocated + overhead
    headroom = usable - required
    unmodelled = unmodelled_paths(estimate)
    margin = UNMODELLED_MARGIN if unmodelled else AT_RISK_FRACTION
    safe_line = int(memory * margin)
    status = "does not fit" if headroom < 0 else "at risk" if headroom < safe_line else "fits"
    acts = estimate.profile.activations
    uncounted = estimate.options.activations and (acts is None or acts.method != "traced")
    if status == "fits" and uncounted:
        # no margin covers activations that were not counted at all: only a measurement can say "fits"
        status = "at risk"
    counted = ", ".join(f"{item.label.lower()} {item.human}" for item in breakdown.device_items if item.bytes)
    # the largest allocated peak that stays clear of the at-risk line, for the changes we try
    target = int((usable - safe_line - CUDA_CONTEXT_BYTES) / (1 + ALLOCATOR_FRAGMENTATION))
    suggestions = [] if status == "fits" else suggest(estimate.profile, estimate.options, target)
    layout = _describe_layout(estimate.options)
    kept = f" ({reserve_fraction:.0%} of it kept back)" if reserve_fraction else ""
    need = (f"{human_bytes(required)} per device for {layout}: {breakdown.device_total} allocated at the peak + "
            f"{human_bytes(overhead)} for the allocator")
    if status == "fits":
        message = f"Fits: {need}, on {human_bytes(memory)} devices{kept}, headroom {human_bytes(headroom)}."
    elif status == "at risk" and uncounted:
        message = (f"At risk: {need}, on {human_bytes(memory)} devices{kept}, headroom {human_bytes(headroom)}, but that "
                   f"counts no activations: they are not estimated for this model ({(acts.note if acts else '') or 'no trace was run'}), "
                   "and no margin makes an unknown amount safe. `--measure` runs real steps and decides.")
    elif status == "at risk":
        why = (f"the {margin:.0%} margin an estimate needs where it meets paths it does not model ({'; '.join(unmodelled)})"
               if unmodelled else f"the {AT_RISK_FRACTION:.0%} margin that an estimate's error and the allocator's variation need")
        message = (f"At risk: {need}, on {human_bytes(memory)} devices{kept}: only {human_bytes(headroom)} "
                   f"({headroom / memory:.1%}) would stay free, under {why}. `--measure` runs real steps and decides.")
    else:
        message = (f"Does not fit: {need}, but the devices have {human_bytes(usable)}{kept} "
                   f"({human_bytes(-headroom)} short).")
    if status != "fits":
        if suggestions:
            message += f" Smallest change that buys room: {suggestions[0].change} ({suggestions[0].device_total} allocated per device)."
        else:
            message += (" None of the changes we try (checkpointing, a smaller batch, ZeRO/FSDP stages, offload, another "
                        "optimizer, more processes or machines, and pairs of these) buys enough room.")
    return FitVerdict(
        fits=status == "fits", device_memory_bytes=memory, device_memory=human_bytes(memory), device_source=where,
        reserve_fraction=reserve_fraction, usable_bytes=usable, required_bytes=required, required=human_bytes(required),
        headroom_bytes=headroom, headroom=human_bytes(headroom), headroom_fraction=headroom / memory,
        counted=counted, suggestions=suggestions, message=message, status=status, allocated_peak_bytes=allocated,
        allocator_overhead_bytes=overhead, reserve_explained=explained, unmodelled=unmodelled, margin_fraction=margin,
    )


def unmodelled_paths(estimate: MemoryEstimate) -> list[str]:
    """What the estimate met and did not model, in words; empty when every part was modelled."""
    found: list[str] = []
    profile, options = estimate.profile, estimate.options
    acts = profile.activations if profile is not None else None
    if options.activations and (acts is None or acts.method != "traced"):
        found.append("activations not traced" + (f" ({acts.note})" if acts is not None and acts.note else ""))
    if acts is not None and acts.method == "traced" and acts.attention_implementation not in (None, *MODELLED_ATTENTION):
        found.append(f"attention implementation `{acts.attention_implementation}` (its kernels are not stood in for)")
    if acts is not None and "padded to" in acts.attention_detail:
        # modelled (padded copies of q, k, v), but issue 25's H200 report implies a peak ~16% above this estimate
        # for head dim 100, and no committed GPU measurement covers the path yet
        found.append("flash attention on a head dim padded to a multiple of 8 (not yet confirmed on a GPU)")
    if acts is not None and UNKNOWN_AUTOCAST in acts.attention_detail:
        found.append("ops whose CUDA autocast policy this package has not transcribed (traced in fp32)")
    if options.strategy in DEEPSPEED_STRATEGIES and options.contiguous_gradients is False:
        # every ZeRO rule here follows DeepSpeed's contiguous path (stage_1_and_2.py, stage3.py): the bucket each
        # gradient is copied into; without it gradients stay separate tensors and are flattened to be reduced
        found.append("DeepSpeed's `contiguous_gradients: false` (the estimate follows its default, true)")
    config = estimate.source.config or {}
    if config.get("auto_map"):
        found.append("the model's own modeling code (config `auto_map`)")
    return found


def _describe_layout(options: EstimateOptions) -> str:
    parts = [options.strategy or "ddp", f"{options.num_processes} process(es)"]
    if options.num_machines > 1:
        parts.append(f"{options.num_machines} machines")
    if options.mixed_precision != "no":
        parts.append(options.mixed_precision)
    if options.offload != "none":
        parts.append(f"offload {options.offload}")
    parts.append(options.optimizer)
    parts.append(f"batch {options.batch_size}")
    if options.gradient_checkpointing:
        parts.append("gradient checkpointing")
    return ", ".join(parts)


def _single_changes(profile: ModelProfile, options: EstimateOptions) -> list[tuple[str, dict]]:
    """Candidate one-knob changes, least disruptive first (code change < batch < launcher config < hardware)."""
    changes: list[tuple[str, dict]] = []
    traced = profile.activations is not None and profile.activations.method == "traced"
    if traced and not options.gradient_checkpointing and profile.activations.per_layer_bytes:
        changes.append(("--gradient_checkpointing", {"gradient_checkpointing": True}))
    strategy = options.strategy
    ladder = {
        "ddp": ["zero1", "zero2", "fsdp_shard_grad_op", "zero3", "fsdp_full_shard"],
        "zero1": ["zero2", "zero3"], "zero2": ["zero3"],
        "fsdp_shard_grad_op": ["fsdp_full_shard"], "fsdp_hybrid_shard": ["fsdp_full_shard"],
    }.get(strategy, [])
    # sharding only helps with several processes, but ZeRO's offload helps even on one device
    if options.num_processes > 1:
        changes.extend((f"--strategy {name}", {"strategy": name}) for name in ladder)
    if strategy == "ddp":
        changes.append(("--strategy zero2 --offload optimizer", {"strategy": "zero2", "offload": "optimizer"}))
    if strategy != "zero3":
        changes.append(("--strategy zero3 --offload optimizer+params", {"strategy": "zero3", "offload": "optimizer+params"}))
    if options.optimizer in ("adam", "adamw"):
        changes.append(("--optimizer adamw_8bit", {"optimizer": "adamw_8bit"}))
        changes.append(("--optimizer adafactor", {"optimizer": "adafactor"}))
    if strategy in DEEPSPEED_STRATEGIES and options.offload == "none":
        changes.append(("--offload optimizer", {"offload": "optimizer"}))
    if strategy == "zero3" and options.offload != "optimizer+params":
        changes.append(("--offload optimizer+params", {"offload": "optimizer+params"}))
    if strategy in FSDP_STRATEGIES and options.offload == "none":
        changes.append(("--offload optimizer+params", {"offload": "optimizer+params"}))
    return changes


class _Search:
    """Tries candidate options against the usable memory and keeps the ones that fit, in the order tried."""

    def __init__(self, profile: ModelProfile, options: EstimateOptions, usable: int) -> None:
        self.profile, self.options, self.usable = profile, options, usable
        self.found: list[Suggestion] = []

    def total(self, options: EstimateOptions) -> int | None:
        try:
            return device_breakdown(self.profile, options).device_total_bytes
        except UsageError:
            return None

    def attempt(self, change: str, patch: dict) -> bool:
        candidate = self.options.model_copy(update=patch)
        total = self.total(candidate)
        if total is None or total > self.usable:
            return False
        self.found.append(Suggestion(change=change, options=candidate, device_total_bytes=total,
                                     device_total=human_bytes(total), fits=True))
        return True

    def smaller_batch(self, patch: dict, prefix: str = "") -> None:
        acts = self.profile.activations
        if acts is None or acts.method != "traced" or self.options.batch_size <= 1:
            return
        base = self.options.model_copy(update=patch)
        low, high, best = 1, self.options.batch_size - 1, None
        while low <= high:
            middle = (low + high) // 2
            total = self.total(base.model_copy(update={"batch_size": middle}))
            if total is not None and total <= self.usable:
                best, low = middle, middle + 1
            else:
                high = middle - 1
        if best is not None:
            self.attempt(f"{prefix} --batch_size {best}".strip(), {**patch, "batch_size": best})

    def more_processes(self, patch: dict, prefix: str = "") -> None:
        if self.options.model_copy(update=patch).strategy == "ddp":
            return  # DDP keeps a full copy on every device; more of them does not help
        machines = self.options.num_machines
        for per_machine in range(self.options.num_processes // machines + 1, MAX_PROCESSES_PER_MACHINE + 1):
            processes = per_machine * machines
            if self.attempt(f"{prefix} --num_processes {processes}".strip(), {**patch, "num_processes": processes}):
                return


    def more_machines(self, patch: dict, prefix: str = "") -> None:
        if self.options.model_copy(update=patch).strategy in ("ddp", "fsdp_hybrid_shard"):
            return  # neither shards across machines
        per_machine = self.options.num_processes // self.options.num_machines
        for factor in (2, 4, 8):
            machines = self.options.num_machines * factor
            change = f"{prefix} --num_machines {machines} --num_processes {per_machine * machines}".strip()
            if self.attempt(change, {**patch, "num_machines": machines, "num_processes": per_machine * machines}):
                return


def suggest(profile: ModelProfile, options: EstimateOptions, usable: int) -> list[Suggestion]:
    """Changes that make the run fit, the smallest first; pairs of changes only when no single one does."""
    search = _Search(profile, options, usable)
    singles = _single_changes(profile, options)
    checkpointing = [c for c in singles if "gradient_checkpointing" in c[1]]
    others = [c for c in singles if "gradient_checkpointing" not in c[1]]
    for change, patch in checkpointing:
        search.attempt(change, patch)
    search.smaller_batch({})
    for change, patch in others:
        search.attempt(change, patch)
    search.more_processes({})
    search.more_machines({})
    if not search.found:
        for (change_a, patch_a), (change_b, patch_b) in itertools.combinations(singles, 2):
            if not set(patch_a) & set(patch_b):
                search.attempt(f"{change_a} {change_b}", {**patch_a, **patch_b})
        for change, patch in singles:
            search.smaller_batch(patch, change)
            search.more_processes(patch, change)
            search.more_machines(patch, change)
    return search.found[:MAX_SUGGESTIONS]


def check_measured(estimate: MemoryEstimate, measured: MeasuredPeak, device_memory: str | int | None = None,
                   reserve_fraction: float = DEFAULT_RESERVE_FRACTION) -> FitVerdict:
    """The fit verdict from a `--measure` probe (memory/probe.py), next to the estimate's.

    The verdict rests on the measurement where one process can measure the layout (DDP: the probe's peak,
    plus DDP's gradient buckets from the estimate when several processes run); an out-of-memory probe is
    "does not fit: measured". For ZeRO/FSDP the probe measured an unsharded single device, so the estimate's
    verdict stands and the measurement is attached; so it does when the probe could not run.
    """
    estimated = check_fit(estimate, device_memory, reserve_fraction)
    memory = estimated.device_memory_bytes
    if measured.device_total_bytes and device_memory is None:
        memory = measured.device_total_bytes
    usable = int(memory * (1 - reserve_fraction))
    strategy = estimate.options.strategy or "ddp"
    if measured.outcome == "failed" or strategy not in ("ddp",):
        note = (f" The probe measured an unsharded single device ({measured.describe()}); a {strategy} layout shares "
                "states across processes, so the verdict stays with the estimate." if measured.outcome != "failed"
                else f" Measuring failed: {measured.error}; the verdict stays with the estimate.")
        return estimated.model_copy(update={"measured": measured, "message": estimated.message + note})
    if measured.outcome == "out of memory":
        message = (f"Does not fit: measured. Real training steps of the model on {measured.device} ran out of memory "
                   f"({measured.error}). The estimate said {estimated.required} per device.")
        return estimated.model_copy(update={"fits": False, "status": "does not fit", "basis": "measured", "measured": measured,
                                            "message": message, "headroom_bytes": min(estimated.headroom_bytes, -1)})
    buckets = estimate.breakdown.item("communication_buffers").bytes if estimate.breakdown is not None else 0
    required = (measured.needed_bytes or 0) + buckets
    headroom = usable - required
    margin = AT_RISK_FRACTION
    status = "does not fit" if headroom < 0 else "at risk" if headroom < memory * margin else "fits"
    added = f" + DDP gradient buckets {human_bytes(buckets)} from the estimate" if buckets else ""
    said = (f"the estimate said {estimated.required} with the CUDA allowances" if measured.reserved_peak_bytes is not None
            else f"the estimate's allocated peak was {human_bytes(estimated.allocated_peak_bytes)}")
    need = f"{human_bytes(required)} measured ({measured.describe()}{added}); {said}"
    if status == "fits":
        message = f"Fits (measured): {need}; on {human_bytes(memory)} devices, headroom {human_bytes(headroom)}."
    elif status == "at risk":
        message = (f"At risk (measured): {need}; on {human_bytes(memory)} devices only {human_bytes(headroom)} "
                   f"({headroom / memory:.1%}) stays free, under the {margin:.0%} margin.")
    else:
        message = f"Does not fit (measured): {need}; the devices have {human_bytes(usable)} ({human_bytes(-headroom)} short)."
    return estimated.model_copy(update={
        "fits": status == "fits", "status": status, "basis": "measured", "measured": measured, "message": message,
        "required_bytes": required, "required": human_bytes(required), "headroom_bytes": headroom, "headroom": human_bytes(headroom),
        "headroom_fraction": headroom / memory, "device_memory_bytes": memory, "device_memory": human_bytes(memory),
        "usable_bytes": usable, "margin_fraction": margin,
    })
