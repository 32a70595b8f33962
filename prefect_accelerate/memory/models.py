"""Pydantic models for `estimate-memory`: the options, what was measured, and what it means.

No torch here: a `MemoryEstimate` carries a `ModelProfile` (plain numbers measured once on the meta
device), so `check_fit` and the Prefect gate can explore other layouts without building the model again.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from prefect_accelerate.memory.choices import (
    ATTN_IMPLEMENTATIONS,
    DEFAULT_DTYPES,
    DTYPES,
    LIBRARIES,
    MIXED_PRECISIONS,
    OFFLOADS,
    OPTIMIZERS,
    STRATEGIES,
)
from prefect_accelerate.memory.units import accelerate_size, human_bytes

Dtype = Literal[DTYPES]  # type: ignore[valid-type]
Library = Literal[LIBRARIES]  # type: ignore[valid-type]
Strategy = Literal[STRATEGIES]  # type: ignore[valid-type]
Offload = Literal[OFFLOADS]  # type: ignore[valid-type]
Optimizer = Literal[OPTIMIZERS]  # type: ignore[valid-type]
MixedPrecision = Literal[MIXED_PRECISIONS]  # type: ignore[valid-type]
AttnImplementation = Literal[ATTN_IMPLEMENTATIONS]  # type: ignore[valid-type]
SourceKind = Literal["local", "hf-cache", "hub", "timm"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EstimateOptions(_Frozen):
    """Everything that changes an estimate besides the model itself.

    ``strategy=None`` asks for Accelerate's table only; any strategy adds the per-device breakdown.
    ``num_processes`` counts processes on all machines together, as `accelerate launch` does.
    """

    library_name: Library | None = None
    dtypes: tuple[Dtype, ...] = DEFAULT_DTYPES
    trust_remote_code: bool = False
    model_class: str | None = None
    strategy: Strategy | None = None
    num_processes: int = Field(1, ge=1)
    num_machines: int = Field(1, ge=1)
    offload: Offload = "none"
    optimizer: Optimizer = "adamw"
    mixed_precision: MixedPrecision = "no"
    gradient_checkpointing: bool = False
    batch_size: int = Field(1, ge=1)
    seq_len: int | None = Field(None, ge=1)
    activations: bool = True
    attn_implementation: AttnImplementation | None = Field(
        None, description="transformers attention to model: eager, sdpa or flash_attention_2 (None: the config's, else transformers' pick)")
    device_type: Literal["cuda", "cpu"] = Field(
        "cuda", description="where training runs: CUDA's attention and dropout kernels, or CPU's own (for checks on CPU)")
    cuda_capability: str | None = Field(
        None, pattern=r"^\d+\.\d+$",
        description="compute capability of the target GPU for the attention kernel rules, e.g. 9.0 (H100/H200), 8.0 "
                    "(A100), 8.9 (L4); None: this machine's GPU, else 9.0")
    reduce_bucket_size: int | Literal["auto"] | None = Field(
        None, description="DeepSpeed's `zero_optimization.reduce_bucket_size` (elements; 'auto': Accelerate fills in "
                          "hidden_size squared); None: DeepSpeed's default, 5e8")
    overlap_comm: bool | None = Field(
        None, description="DeepSpeed's `zero_optimization.overlap_comm` (ZeRO-1/2 then keep two reduce buckets); None: "
                          "DeepSpeed's default, on for ZeRO-3 only")
    contiguous_gradients: bool | None = Field(
        None, description="DeepSpeed's `zero_optimization.contiguous_gradients`; None: DeepSpeed's default, true (the only "
                          "path the estimate models: false is reported as not modelled)")
    prefetch_bucket_size: int | Literal["auto"] | None = Field(
        None, description="DeepSpeed's `zero_optimization.stage3_prefetch_bucket_size` (elements; 'auto': Accelerate fills "
                          "in 0.9 x hidden_size squared); None: DeepSpeed's default, 5e7")
    max_live_parameters: int | None = Field(
        None, ge=0, description="DeepSpeed's `zero_optimization.stage3_max_live_parameters`; None: DeepSpeed's default, 1e9")
    max_reuse_distance: int | None = Field(
        None, ge=0, description="DeepSpeed's `zero_optimization.stage3_max_reuse_distance`; None: DeepSpeed's default, 1e9")
    sub_group_size: int | None = Field(
        None, ge=0, description="DeepSpeed's `zero_optimization.sub_group_size` (ZeRO-3 steps the optimizer a sub-group "
                                "at a time); None: DeepSpeed's default, 1e9")


class ModelSource(_Frozen):
    """Where the model's description came from; nothing here needs torch."""

    name: str
    kind: SourceKind
    library: Library
    location: str
    config_sha256: str
    config: dict | None = Field(default=None, exclude=True, repr=False)

    def describe(self) -> str:
        where = {
            "local": f"the folder {self.location}",
            "hf-cache": f"the Hugging Face cache ({self.location})",
            "hub": f"the Hugging Face Hub (config cached at {self.location})",
            "timm": f"timm's registry (architecture `{self.location}`)",
        }[self.kind]
        return f"`{self.name}` from {where}, library {self.library}"


class TableRow(_Frozen):
    """One row of Accelerate's table; the numbers keep Accelerate's types (int for float32, float after a division)."""

    dtype: Dtype
    largest_layer_bytes: int | float
    total_bytes: int | float
    training_bytes: int | float | None = Field(description="Accelerate's 'Training using Adam' (max of model, gradients, optimizer, step); None prints N/A")
    largest_layer: str
    total: str
    training: str

    @classmethod
    def build(cls, dtype: str, largest: int | float, total: int | float, training: int | float | None) -> TableRow:
        return cls(
            dtype=dtype, largest_layer_bytes=largest, total_bytes=total, training_bytes=training,
            largest_layer=accelerate_size(largest), total=accelerate_size(total),
            training=accelerate_size(training) if training is not None else "N/A",
        )


class AccelerateTable(_Frozen):
    """What `accelerate estimate-memory` prints, with the same numbers."""

    title: str
    measured_class: str
    largest_layer_names: list[str]
    rows: list[TableRow]


class ActivationProfile(_Frozen):
    """Activation memory of one training step, measured by tracing forward on fake tensors.

    Byte figures are for ``batch_size`` samples of ``seq_len`` tokens (or one image size); they scale
    linearly with the batch. ``per_layer_bytes`` holds what each transformer block saves for backward.
    """

    method: Literal["traced", "not estimated"]
    batch_size: int
    seq_len: int | None = None
    input_description: str
    precision_mode: str
    saved_bytes: int = 0
    outside_layers_bytes: int = 0
    outside_after_layers_bytes: int = Field(0, description="the part of outside_layers_bytes saved after the first block "
                                                          "(final norm, head, loss): freed before any block's backward")
    per_layer_bytes: list[int] = Field(default_factory=list)
    layer_input_bytes: int = 0
    retained_output_bytes: int = 0
    largest_tensor_bytes: int = 0
    largest_layer_tensor_bytes: int = Field(0, description="the largest tensor a block saves (its backward's temporaries "
                                                           "scale with it when a checkpointed block is recomputed)")
    block_backward_peak_bytes: int = Field(0, description="what one block holds at the worst moment of its own backward: "
                                           "the tensors it saved up to some op plus two of that op's size (its gradient "
                                           "and the next), the largest over its ops in forward order; 0 when not traced")
    block_backward_measured: bool = Field(False, description="block_backward_peak_bytes was measured by running backward "
                                          "on the fake tensors (every temporary the block's own backward code makes, its "
                                          "saved tensors freed as it goes; weights' gradients left out) rather than bounded")
    block_backward_rise_bytes: int = Field(0, description="measured: the most live memory rose above its start while one "
                                           "block's backward ran, the gradient it started from included (0: not measured)")
    head_backward_bytes: int = Field(0, description="measured: at the highest point of backward before the first block's "
                                     "backward began (the loss, the output layer, the final norm), how far the tensors "
                                     "other than weights' gradients had risen above backward's start")
    head_backward_gradient_bytes: int = Field(0, description="measured: the weights' gradients made by that highest point "
                                              "(they do not grow with the batch)")
    head_gradient_bytes: int = Field(0, description="measured: the weights' gradients the head's phase makes (alive from "
                                     "then to the optimizer step), a tied embedding's gradient the head starts included")
    head_left_bytes: int = Field(0, description="measured: what the head's phase made that is still alive when the first "
                                 "block's backward begins, besides that block's incoming gradient and weights' gradients")
    head_backward_measured: bool = False
    unreached_parameters: int = Field(0, description="measured: trainable parameters the loss gives no gradient in the "
                                      "fake backward (no .grad, no optimizer state in torch.optim's per-tensor state)")
    forward_peak_bytes: int = Field(0, description="measured: the most live memory at once during the forward, counted from "
                                    "its start (what it saves, its outputs, and the temporaries of the moment)")
    block_forward_rise_bytes: int = Field(0, description="measured: the most live memory rose above its start during one "
                                          "block call's forward (a checkpointed forward holds one block's at a time)")
    block_carry_bytes: list[int] = Field(default_factory=list, description="measured: per block call, in forward order, "
                                         "what the model still held of the previous call's outputs when it started, "
                                         "besides this call's own inputs (a stack that keeps `outputs = block(...)` holds "
                                         "the attention weights a block returns until the next one returns)")
    block_checkpointed_rises: list[int] = Field(default_factory=list, description="measured, per block call: the most "
                                                "live memory rose above the call's start in a forward that keeps no "
                                                "saved tensor, as activation checkpointing runs it (temporaries and "
                                                "the output)")
    forward_measured: bool = False
    block_input_bytes: list[int] = Field(default_factory=list, description="per block call, in forward order: its "
                                         "floating-point tensor inputs (what checkpointing keeps of it)")
    block_backward_peaks: list[int] = Field(default_factory=list, description="measured, per block call in forward order: "
                                            "what it saved plus, at the highest point of its own backward, how far the "
                                            "activations rose above its start (its incoming gradient included); empty "
                                            "when backward was not measured")
    block_backward_gradient_bytes: list[int] = Field(default_factory=list, description="measured, per block call: the "
                                                     "weights' gradients its backward had made by that highest point")
    block_recompute_peaks: list[int] = Field(default_factory=list, description="measured, per block call: what its "
                                             "forward rose to above its start, plus its incoming gradient: what "
                                             "recomputing it under checkpointing holds at its worst moment")
    block_backward_waiting_bytes: list[int] = Field(default_factory=list, description="measured, per block call: what "
                                                    "the backward of later blocks made and still held when its backward "
                                                    "began, besides its incoming gradient (the summed gradient of a tensor "
                                                    "several blocks take, waiting for the backward of what made it)")
    outside_gap_bytes: list[int] = Field(default_factory=list, description="tensors saved outside the blocks, by where "
                                         "forward saved them: before block g for g = 0..blocks-1, and last the head's "
                                         "(an encoder-decoder saves between its two stacks)")
    block_cast_bytes: list[int] = Field(default_factory=list, description="per block call: autocast's 16-bit copies of its "
                                        "weights that it saves for backward (part of autocast_weight_copy_bytes)")
    block_parameters: list[int] = Field(default_factory=list, description="per block call: the trainable parameters whose "
                                        "gradients its backward makes")
    block_saved_input_bytes: int = Field(0, description="the part of a block's saved tensors that are its own inputs (the "
                                         "residual stream its first norm saves), the least over blocks: checkpointing "
                                         "keeps them as the block's inputs already, and recomputing makes no copy")
    autocast_weight_copy_bytes: int = 0
    cache_bytes: int = Field(0, description="a KV cache the model's output holds (transformers' DynamicCache); the loop keeps it through the step")
    cache_unsaved_bytes: int = Field(0, description="the part of that cache that is not also saved for backward (alive from forward on)")
    attention_implementation: str | None = Field(None, description="transformers' attention implementation the trace ran")
    attention_kernels: list[str] = Field(default_factory=list, description="CUDA SDPA kernels stood in for: flash, efficient, cudnn, math")
    attention_backward_bytes: int = Field(0, description="the largest temporary one attention backward allocates beyond the "
                                                         "q/k/v gradients (memory-efficient's gradient of a mask that requires grad)")
    attention_detail: str = Field("", description="why those kernels: torch release and compute capability whose rules "
                                                  "applied, backends refused and the first rule each failed")
    note: str = ""


class ModelProfile(_Frozen):
    """Plain numbers about the model that will really be trained (its class with the head, ties counted once)."""

    trained_class: str
    parameters: int
    trainable_parameters: int
    buffer_bytes: int
    largest_tensor_numel: int
    small_tensor_numel: int = Field(description="parameters in tensors under 4096 elements (bitsandbytes keeps those in 32-bit)")
    adafactor_state_numel: int = Field(description="elements of Adafactor's factored second moments")
    largest_module_parameters: int = Field(description="DeepSpeed's 'largest layer': most parameters held directly by one module")
    layer_class_names: list[str] = Field(default_factory=list)
    layer_count: int = 0
    largest_unit_parameters: int = Field(0, description="parameters of the biggest FSDP unit (one block)")
    root_unit_parameters: int = Field(0, description="parameters outside every block (embeddings, head): FSDP's root unit")
    hidden_size: int | None = None
    activations: ActivationProfile | None = None


class MemoryItem(_Frozen):
    key: str
    label: str
    bytes: int
    human: str
    formula: str

    @classmethod
    def of(cls, key: str, label: str, value: float, formula: str) -> MemoryItem:
        value = int(round(value))
        return cls(key=key, label=label, bytes=value, human=human_bytes(value), formula=formula)


class DeviceBreakdown(_Frozen):
    """Per-device memory for one training layout, and what CPU offload needs on each machine."""

    strategy: Strategy
    world_size: int
    num_machines: int
    processes_per_machine: int
    shard_factor: int
    mixed_precision: MixedPrecision
    optimizer: Optimizer
    offload: Offload
    overlap_comm: bool | None = Field(None, description="ZeRO layouts: DeepSpeed's overlap_comm as estimated (its "
                                                        "default: on for ZeRO-3, off below); None for the others")
    gradient_checkpointing: bool
    batch_size: int
    seq_len: int | None
    trained_class: str
    parameters: int
    device_items: list[MemoryItem]
    device_total_bytes: int = Field(description="peak of live tensors: resident items + max(activations + backward temporaries "
                                                "(+ ZeRO's prefetch bucket or reduction copy), gradients + step temporaries + "
                                                "outputs kept through the step)")
    device_total: str
    all_items_bytes: int = Field(description="every item added up: an upper bound on the peak")
    model_states_bytes: int = Field(description="parameters + gradients + optimizer states + gathered layers on one device")
    cpu_items: list[MemoryItem]
    cpu_per_machine_bytes: int
    cpu_per_machine: str
    activations_method: str
    attention: str = Field("", description="the attention modelled, e.g. 'sdpa (CUDA kernel: flash)'")
    notes: list[str] = Field(default_factory=list)

    def item(self, key: str) -> MemoryItem | None:
        return next((i for i in self.device_items if i.key == key), None)


class MemoryEstimate(_Frozen):
    """The result of `estimate`: Accelerate's table, and the per-device breakdown when a strategy was given."""

    model: str
    source: ModelSource
    options: EstimateOptions
    table: AccelerateTable
    profile: ModelProfile | None = None
    breakdown: DeviceBreakdown | None = None
    package_version: str


class Suggestion(_Frozen):
    change: str
    options: EstimateOptions
    device_total_bytes: int
    device_total: str
    fits: bool


class MeasuredPeak(_Frozen):
    """What `--measure` found: real training steps of the model with random weights on a device (memory/probe.py)."""

    outcome: Literal["ok", "out of memory", "failed"]
    device: str = Field(description="the device measured on: a GPU's name, or CPU")
    what: str = Field(description="what the figures are, in words")
    torch: str = ""
    steps: int = 0
    allocated_peak_bytes: int | None = Field(
        None, description="CUDA: torch.cuda.max_memory_allocated(); CPU: the peak of PyTorch's CPU allocator's own accounting")
    reserved_peak_bytes: int | None = Field(None, description="CUDA: torch.cuda.max_memory_reserved()")
    outside_allocator_bytes: int | None = Field(None, description="CUDA: device memory in use outside PyTorch's allocator")
    device_total_bytes: int | None = None
    rss_peak_growth_bytes: int | None = Field(None, description="CPU: growth of the process's peak resident set size")
    error: str = ""

    @property
    def needed_bytes(self) -> int | None:
        """What the device must hold for the measured run: reserved peak + outside the allocator (CUDA), RSS growth (CPU)."""
        if self.reserved_peak_bytes is not None:
            return self.reserved_peak_bytes + (self.outside_allocator_bytes or 0)
        return self.rss_peak_growth_bytes

    def describe(self) -> str:
        if self.outcome == "failed":
            return f"not measured: {self.error}"
        if self.reserved_peak_bytes is not None:
            figures = (f"allocated peak {human_bytes(self.allocated_peak_bytes or 0)}, reserved peak "
                       f"{human_bytes(self.reserved_peak_bytes)}, outside the allocator {human_bytes(self.outside_allocator_bytes or 0)}")
        else:
            figures = f"peak RSS growth {human_bytes(self.rss_peak_growth_bytes or 0)}"
            if self.allocated_peak_bytes is not None:
                figures = f"allocated peak {human_bytes(self.allocated_peak_bytes)}, {figures}"
        head = "ran out of memory" if self.outcome == "out of memory" else f"{self.steps} training step(s)"
        return f"{head} on {self.device} (torch {self.torch}): {figures} [{self.what}]"


class FitVerdict(_Frozen):
    """Whether one device holds the run, with headroom, and the smallest change that would make it fit.

    ``fits`` is True only with a safe margin (``status == "fits"``); ``required_bytes`` is what the CUDA
    allocator will need: the allocated peak plus ``allocator_overhead_bytes``.
    """

    fits: bool
    device_memory_bytes: int
    device_memory: str
    device_source: str
    reserve_fraction: float
    usable_bytes: int
    required_bytes: int
    required: str
    headroom_bytes: int
    headroom: str
    headroom_fraction: float
    counted: str
    suggestions: list[Suggestion] = Field(default_factory=list)
    message: str
    status: Literal["fits", "at risk", "does not fit"] = "fits"
    allocated_peak_bytes: int = Field(0, description="the estimate's peak of live tensors (torch.cuda.max_memory_allocated)")
    allocator_overhead_bytes: int = Field(0, description="CUDA context and workspaces + caching-allocator rounding and fragmentation")
    reserve_explained: str = ""
    basis: Literal["estimate", "measured"] = Field("estimate", description="what the verdict rests on")
    measured: MeasuredPeak | None = None
    unmodelled: list[str] = Field(default_factory=list, description="paths the estimate did not model; they widen the margin")
    margin_fraction: float = Field(0.05, description="share of the device that must stay free for 'fits'")

    @property
    def best(self) -> Suggestion | None:
        return self.suggestions[0] if self.suggestions else None
