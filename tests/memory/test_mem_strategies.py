"""Per-strategy arithmetic: ZeRO figures against DeepSpeed's own estimators, layouts that cannot run, invariants."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefect_accelerate.errors import UsageError
from prefect_accelerate.memory import EstimateOptions, estimate
from prefect_accelerate.memory.models import ActivationProfile, ModelProfile
from prefect_accelerate.memory.strategies import device_breakdown, resident_keys


def profile(parameters: int = 7_000_000_000, largest: int = 500_000_000, **extra) -> ModelProfile:
    values = {
        "trained_class": "Synthetic", "parameters": parameters, "trainable_parameters": parameters, "buffer_bytes": 0,
        "largest_tensor_numel": largest, "small_tensor_numel": 0, "adafactor_state_numel": parameters // 100,
        "largest_module_parameters": largest, "layer_class_names": ["Block"], "layer_count": 32,
        "largest_unit_parameters": parameters // 40, "root_unit_parameters": parameters // 5,
    }
    values.update(extra)
    return ModelProfile(**values)


def layout(strategy: str, per_node: int, nodes: int, offload: str = "none", **extra) -> EstimateOptions:
    return EstimateOptions(strategy=strategy, num_processes=per_node * nodes, num_machines=nodes, offload=offload,
                           mixed_precision=extra.pop("mixed_precision", "bf16"), **extra)


@pytest.fixture(scope="module")
def deepspeed_estimators():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    return estimate_zero2_model_states_mem_needs, estimate_zero3_model_states_mem_needs


SETUPS = [(7_000_000_000, 500_000_000, 8, 2), (124_439_808, 38_597_376, 4, 1), (70_553_706_496, 1_050_673_152, 8, 4),
          (1_000_003, 4_096, 3, 1), (46_702_792_704, 1_409_286_144, 16, 1)]


@pytest.mark.parametrize("parameters,largest,per_node,nodes", SETUPS)
@pytest.mark.parametrize("offload", ["none", "optimizer"])
def test_zero2_model_states_agree_with_deepspeed(deepspeed_estimators, parameters, largest, per_node, nodes, offload):
    zero2, _ = deepspeed_estimators
    cpu, gpu = zero2(parameters, per_node, nodes, cpu_offload=offload != "none")
    ours = device_breakdown(profile(parameters, largest), layout("zero2", per_node, nodes, offload))
    assert abs(ours.model_states_bytes - gpu) <= 3  # each of our items is rounded to a byte
    assert abs(ours.cpu_per_machine_bytes - cpu) <= 1


@pytest.mark.parametrize("parameters,largest,per_node,nodes", SETUPS)
@pytest.mark.parametrize("offload", ["none", "optimizer", "optimizer+params"])
def test_zero3_model_states_agree_with_deepspeed(deepspeed_estimators, parameters, largest, per_node, nodes, offload):
    _, zero3 = deepspeed_estimators
    cpu, gpu, _ = zero3(parameters, largest, per_node, nodes, cpu_offload=offload != "none",
                        cpu_offload_params=offload == "optimizer+params", zero_init=True)
    ours = device_breakdown(profile(parameters, largest), layout("zero3", per_node, nodes, offload))
    assert abs(ours.model_states_bytes + _zero3_gradient_gap(parameters, per_node * nodes, offload) - gpu) <= 3
    assert abs(ours.cpu_per_machine_bytes - cpu) <= 1


def _zero3_gradient_gap(parameters: int, world: int, offload: str = "none", weight_bytes: int = 2) -> int:
    """DeepSpeed's estimator counts ZeRO-3's gradient partition as fp32 (4 B x P / S); the run keeps it in the
    weights' dtype from start-up (stage3.py, `grad_partitions_flat_buffer`) and makes the fp32 copy only during
    the step, a sub-group at a time (counted there)."""
    return 0 if offload != "none" else round((4 - weight_bytes) * parameters / world)


def test_zero_figures_for_a_real_model_agree_with_deepspeed(deepspeed_estimators, zoo):
    zero2, zero3 = deepspeed_estimators
    for strategy in ("zero2", "zero3"):
        result = estimate(str(zoo["gpt2"]), layout(strategy, 8, 1, activations=False, dtypes=("float32",)))
        p, largest = result.profile.parameters, result.profile.largest_module_parameters
        assert largest == 50257 * 768  # the tied embedding / head, DeepSpeed's "largest layer"
        gpu = zero2(p, 8, 1, cpu_offload=False)[1] if strategy == "zero2" else zero3(p, largest, 8, 1, cpu_offload=False, cpu_offload_params=False)[1]
        gap = _zero3_gradient_gap(p, 8) if strategy == "zero3" else 0
        assert abs(result.breakdown.model_states_bytes + gap - result.profile.buffer_bytes - gpu) <= 3


def test_ddp_keeps_sixteen_bytes_per_parameter_for_adamw_in_fp32():
    b = device_breakdown(profile(1_000_000, 1000), EstimateOptions(strategy="ddp"))
    assert b.model_states_bytes == 16 * 1_000_000
    assert b.item("communication_buffers").bytes == 0  # one process: no DDP wrapper, no buckets
    assert device_breakdown(profile(1_000_000, 1000), EstimateOptions(strategy="ddp", num_processes=2)).item("communication_buffers").bytes == 4_000_000


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("parameters", [3_000_000, 350_000_000, 7_000_000_000])
def test_zeros_reduce_bucket_is_allocated_whole_whatever_the_models_size(strategy, parameters):
    """DeepSpeed allocates `reduce_bucket_size` elements (5e8 by default) in the weights' dtype, not min(P, 5e8):
    a 3M-parameter model measured 2.07 GB per rank in fp32 under ZeRO-2 on 2 processes (bench/memory_sharded_cpu.py)."""
    for precision, width in (("bf16", 2), ("no", 4)):
        b = device_breakdown(profile(parameters, parameters // 10), layout(strategy, 2, 1, mixed_precision=precision))
        assert b.item("communication_buffers").bytes == width * 500_000_000


def test_optimizer_states_per_optimizer():
    p = profile(1_000_000, 1000, small_tensor_numel=10_000, adafactor_state_numel=20_000)
    states = {opt: device_breakdown(p, EstimateOptions(strategy="ddp", optimizer=opt)).item("optimizer_states").bytes
              for opt in ("adamw", "adam", "sgd", "adafactor", "adamw_8bit")}
    assert states["adamw"] == states["adam"] == 8_000_000
    assert states["sgd"] == 4_000_000
    assert states["adafactor"] == 80_000
    assert states["adamw_8bit"] == round(2 * (1 + 4 / 256) * 990_000 + 8 * 10_000)


def test_fsdp_full_shard_gathers_root_and_two_blocks():
    p = profile(1_000_000, 1000, largest_unit_parameters=50_000, root_unit_parameters=200_000)
    b = device_breakdown(p, layout("fsdp_full_shard", 4, 1))
    assert b.item("parameters").bytes == 4 * 1_000_000 / 4
    assert b.item("gathered_layers").bytes == 2 * (200_000 + 2 * 50_000) + 2 * 200_000
    grad_op = device_breakdown(p, layout("fsdp_shard_grad_op", 4, 1))
    assert grad_op.item("gathered_layers").bytes == 2 * 1_000_000 + 2 * 200_000


def test_hybrid_shard_shards_within_a_machine():
    b = device_breakdown(profile(), layout("fsdp_hybrid_shard", 8, 4))
    assert (b.shard_factor, b.world_size) == (8, 32)
    assert b.item("optimizer_states").bytes == device_breakdown(profile(), layout("fsdp_full_shard", 8, 1)).item("optimizer_states").bytes


@pytest.mark.parametrize("strategy,offload,message", [
    ("ddp", "optimizer", "needs a sharded strategy"),
    ("zero2", "optimizer+params", "only with ZeRO-3"),
    ("fsdp_full_shard", "optimizer", "no optimizer-only offload"),
])
def test_layouts_that_cannot_run_are_refused(strategy, offload, message):
    with pytest.raises(UsageError, match=message):
        device_breakdown(profile(), EstimateOptions(strategy=strategy, offload=offload, num_processes=2))


def test_processes_must_divide_into_machines():
    with pytest.raises(UsageError, match="not a multiple of --num_machines"):
        device_breakdown(profile(), EstimateOptions(strategy="zero3", num_processes=5, num_machines=2))


def test_peak_takes_the_larger_of_backward_and_optimizer_step():
    acts = ActivationProfile(method="traced", batch_size=1, input_description="x", precision_mode="fp32",
                             saved_bytes=10_000_000, largest_tensor_bytes=1_000)
    b = device_breakdown(profile(1_000_000, 1000, activations=acts), EstimateOptions(strategy="ddp"))
    by = {item.key: item.bytes for item in b.device_items}
    resident = by["parameters"] + by["optimizer_states"]
    assert b.device_total_bytes == resident + max(by["activations"] + by["backward_temporaries"], by["gradients"] + by["step_temporaries"])
    assert b.all_items_bytes == sum(by.values()) >= b.device_total_bytes


@settings(max_examples=60, deadline=None)
@given(parameters=st.integers(10_000, 10**11), per_node=st.integers(1, 16), nodes=st.integers(1, 8),
       strategy=st.sampled_from(["zero1", "zero2", "zero3", "fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_hybrid_shard"]))
def test_more_processes_never_need_more_memory_per_device(parameters, per_node, nodes, strategy):
    p = profile(parameters, parameters // 50, largest_unit_parameters=parameters // 40, root_unit_parameters=parameters // 10)
    fewer = device_breakdown(p, layout(strategy, per_node, nodes))
    more = device_breakdown(p, layout(strategy, per_node + 1, nodes))
    assert more.device_total_bytes <= fewer.device_total_bytes


@settings(max_examples=40, deadline=None)
@given(parameters=st.integers(10_000, 10**11), per_node=st.integers(2, 16), stage=st.sampled_from(["zero2", "zero3"]))
def test_offloading_never_needs_more_device_memory(parameters, per_node, stage):
    p = profile(parameters, parameters // 50)
    assert (device_breakdown(p, layout(stage, per_node, 1, "optimizer")).device_total_bytes
            <= device_breakdown(p, layout(stage, per_node, 1)).device_total_bytes)


def test_zero3_keeps_the_weights_within_the_reuse_distance_gathered_and_no_more():
    """ZeRO-3 does not release a weight that comes again within stage3_max_reuse_distance (1e9) parameters: every
    weight of a small model stays gathered from forward to backward; a large one keeps about 5e8 of them."""
    small = device_breakdown(profile(3_000_000, 250_000, largest_unit_parameters=600_000), layout("zero3", 2, 1))
    assert small.item("kept_gathered").bytes == 2 * (3_000_000 - 250_000)
    large = device_breakdown(profile(70_000_000_000, 1_050_000_000, largest_unit_parameters=856_000_000),
                             layout("zero3", 8, 1))
    assert large.item("kept_gathered").bytes == 2 * (500_000_000 + 1_050_000_000 - 1_050_000_000)
    # not a ZeRO-1/2 figure, and not part of DeepSpeed's own model-state estimate (held equal above)
    assert all(item.key != "kept_gathered" for item in device_breakdown(profile(), layout("zero2", 8, 1)).device_items)


def test_zero3_holds_its_prefetch_bucket_twice_through_forward_and_backward_but_not_at_the_step():
    """The coalesced all-gather buffer of a prefetch bucket stays until its last weight is used, beside the weights
    copied out of it: stage3_prefetch_bucket_size elements (5e7) plus the one weight that passes it, at most P, at
    most stage3_max_live_parameters, none with prefetch off. It adds to forward and backward, not to the step."""
    small = device_breakdown(profile(3_000_000, 250_000), layout("zero3", 2, 1))
    assert small.item("prefetch_buffer").bytes == 2 * 3_000_000
    big = profile(7_000_000_000, 500_000_000)
    assert device_breakdown(big, layout("zero3", 8, 1)).item("prefetch_buffer").bytes == 2 * (50_000_000 + 500_000_000)
    assert device_breakdown(big, layout("zero3", 8, 1, prefetch_bucket_size=10**6, max_live_parameters=2 * 10**8)
                            ).item("prefetch_buffer").bytes == 2 * 2 * 10**8
    off = device_breakdown(big, layout("zero3", 8, 1, "optimizer", prefetch_bucket_size=0))
    on = device_breakdown(big, layout("zero3", 8, 1, "optimizer"))
    assert off.item("prefetch_buffer").bytes == 0
    # optimizer on CPU: no step on the device, so forward/backward is the peak and holds the bucket
    assert on.device_total_bytes - off.device_total_bytes == on.item("prefetch_buffer").bytes
    # on the device the step is the peak (no activations here): the bucket is gone by then
    stepping = device_breakdown(big, layout("zero3", 8, 1))
    assert stepping.device_total_bytes == device_breakdown(big, layout("zero3", 8, 1, prefetch_bucket_size=0)).device_total_bytes
    assert all(item.key != "prefetch_buffer" for item in device_breakdown(big, layout("zero2", 8, 1)).device_items)


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_zero12_flatten_a_buckets_gradients_to_reduce_them_during_backward_only(stage):
    """Reducing a bucket, ZeRO-1/2 flatten its gradient slices into a new tensor: up to one bucket's contents
    (b x min(reduce_bucket_size, P)), on top of backward; gone by the step."""
    small = device_breakdown(profile(3_000_000, 250_000), layout(stage, 2, 1))
    assert small.item("reduction_copy").bytes == 2 * 3_000_000
    big = profile(7_000_000_000, 500_000_000)
    assert device_breakdown(big, layout(stage, 8, 1)).item("reduction_copy").bytes == 2 * 500_000_000
    one, two = (device_breakdown(big, layout(stage, 8, 1, reduce_bucket_size=size)) for size in (10**6, 10**8))
    assert two.item("reduction_copy").bytes == 2 * 10**8
    # ZeRO-2 releases its bucket at the end of every backward: at the step, the peak here, no bucket is held.
    # ZeRO-1 peaks after backward (no activations here), where a bigger bucket holds what would otherwise be the
    # partition store beside the gradients still to move; the block a previous reduction may leave is a bucket's
    if stage == "zero1":
        assert two.device_total_bytes - one.device_total_bytes == 2 * (10**8 - 10**6)
    else:
        assert two.device_total_bytes == one.device_total_bytes
    offloaded = device_breakdown(big, layout(stage, 8, 1, "optimizer"))  # no step on the device: backward is the peak
    resident = sum(offloaded.item(key).bytes for key in ("parameters", "optimizer_states", "communication_buffers"))
    assert offloaded.device_total_bytes == resident + offloaded.item("reduction_copy").bytes


def test_zero3_keeps_its_gradient_partition_from_start_up_and_makes_the_fp32_copy_at_the_step():
    """The flat gradient partition (weights' dtype) is resident through forward, so it is part of every phase's
    peak; the step adds the fp32 copy of one sub-group (at most 1e9 elements) to the foreach temporary."""
    zero3 = device_breakdown(profile(7_000_000_000, 500_000_000), layout("zero3", 8, 1))
    assert zero3.item("gradients").bytes == 2 * 7_000_000_000 / 8
    assert zero3.item("step_temporaries").bytes == 2 * 4 * min(7_000_000_000 / 8, 1_000_000_000)
    resident = sum(zero3.item(key).bytes for key in ("parameters", "gradients", "optimizer_states", "gathered_layers",
                                                     "kept_gathered", "communication_buffers"))
    # no activations in this profile: the step is the peak, over everything resident, the gradients once
    assert zero3.device_total_bytes == resident + zero3.item("step_temporaries").bytes
    offloaded = device_breakdown(profile(7_000_000_000, 500_000_000), layout("zero3", 8, 1, "optimizer"))
    assert offloaded.item("gradients").bytes == 0  # the flat buffer lives with the optimizer, on CPU
    # a smaller sub_group_size steps less at a time; a sub-group closes once it reaches the size, so it can pass it
    # by one weight's partition (5e8 / 8 here)
    small_groups = device_breakdown(profile(7_000_000_000, 500_000_000), layout("zero3", 8, 1, sub_group_size=10**6))
    assert small_groups.item("step_temporaries").bytes == 2 * 4 * (10**6 + 500_000_000 // 8)


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=True)
    | st.sampled_from(["auto", "cpu", "none", "", float("inf"), float("-inf"), float("nan"), 5e8, 2.5]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["device", "stage", "x"]), inner, max_size=3),
    max_leaves=6)
_ZERO_KEYS = ["stage", "reduce_bucket_size", "overlap_comm", "stage3_prefetch_bucket_size", "prefetch_bucket_size",
              "stage3_max_live_parameters", "stage3_max_reuse_distance", "max_reuse_distance", "offload_param",
              "offload_optimizer"]


@settings(max_examples=300, deadline=None)
@given(zero=st.one_of(_JSON_VALUES, st.dictionaries(st.sampled_from(_ZERO_KEYS), _JSON_VALUES, max_size=6)),
       whole=st.booleans())
@example(zero={"stage3_prefetch_bucket_size": float("inf")}, whole=False)  # int(inf) once raised OverflowError
@example(zero=[{"stage": 3}], whole=True)
def test_any_deepspeed_json_gives_settings_the_estimate_takes_or_one_error_naming_the_file(tmp_path_factory, zero, whole):
    """Whatever `zero_optimization` holds: either settings EstimateOptions accepts, or a UsageError that names the
    file and the field (no other exception, no traceback for the CLI to print)."""
    import json
    import math

    from prefect_accelerate.memory.strategies import DS_JSON_OPTIONS, deepspeed_json_settings

    path = tmp_path_factory.mktemp("ds") / "ds.json"
    path.write_text(json.dumps(zero if whole else {"zero_optimization": zero}))  # Python's json writes Infinity, NaN
    try:
        found = deepspeed_json_settings(str(path))
    except UsageError as error:
        assert str(path) in str(error)
        assert "`zero_optimization" in str(error) or (whole and not isinstance(zero, dict))
        return
    options = EstimateOptions(strategy="zero3", num_processes=2, **{name: found[name] for name in DS_JSON_OPTIONS if name in found})
    for name in ("reduce_bucket_size", "prefetch_bucket_size", "max_live_parameters", "max_reuse_distance"):
        value = getattr(options, name)
        assert value is None or value == "auto" or (isinstance(value, int) and value >= 0 and not math.isnan(value))
    if isinstance(zero, dict) and options.prefetch_bucket_size != "auto" and options.reduce_bucket_size != "auto":
        device_breakdown(profile(), options)  # the arithmetic takes whatever was accepted


@pytest.mark.parametrize("precision", ["bf16", "no"])
def test_zero2_holds_its_bucket_and_gradient_partition_in_backward_only_and_steps_on_its_own_terms(precision):
    """DeepSpeed's ZeRO-2 (stage_1_and_2.py, `contiguous_gradients`): the reduce bucket is made at each backward and
    released at its end; gradients live in it (views) until a flush copies this rank's part out, into a partition
    store made whole at the first flush (so only when P outgrows the bucket); at the step the partition is flattened
    (a second copy) and made fp32 (no copy in fp32), then the optimizer runs with its temporary."""
    p, s = 7_000_000_000, 8
    b = 2 if precision == "bf16" else 4
    states = ("parameters", "optimizer_states")
    # no activations here: the step is the peak unless the bucket is huge
    small = device_breakdown(profile(p, 500_000_000), layout("zero2", s, 1, mixed_precision=precision))
    resident = sum(small.item(key).bytes for key in states)
    step = max(2 * b * p / s + (4 * p / s if b == 2 else 0), 4 * p / s + small.item("step_temporaries").bytes)
    backward = b * 500_000_000 + b * 500_000_000 + b * p / s  # bucket, its flattened copy, the partition store
    assert small.device_total_bytes == round(resident + max(step, backward))
    assert "communication_buffers" not in resident_keys("zero2", "none")
    # a bucket larger than the model: backward holds the bucket and the flattened copy of all gradients, which
    # then live in the bucket (no partition store before the end); that outgrows the step here
    huge = device_breakdown(profile(p, 500_000_000), layout("zero2", s, 1, mixed_precision=precision,
                                                           reduce_bucket_size=50_000_000_000))
    assert huge.device_total_bytes == resident + b * 50_000_000_000 + b * p
    # past the first flush the partition store is there too: a bucket just under P
    under = device_breakdown(profile(p, 500_000_000), layout("zero2", s, 1, mixed_precision=precision,
                                                            reduce_bucket_size=p - 1))
    assert under.device_total_bytes == round(resident + b * (p - 1) + b * (p - 1) + b * p / s)
    # offloaded (not read here from DeepSpeed's offload path), the bucket stays counted for the whole step
    assert "communication_buffers" in resident_keys("zero2", "optimizer")


@pytest.mark.parametrize("precision", ["bf16", "no"])
def test_zero1_makes_whole_gradients_beside_its_bucket_and_reduces_them_after_backward(precision):
    """DeepSpeed's ZeRO-1 without overlap_comm (stage_1_and_2.py): backward's hooks only make the bucket, so each
    gradient is made whole (b x P by backward's end, not an fp32 partition); after backward they are moved into
    the bucket one by one (their own storage freed) and reduced; a flush's copy stands in for the gradients moved,
    and from the second flush on the partition store is there too; the epilogue releases the bucket; the step is
    ZeRO-2's. Qwen2-MoE (139M parameters) measured 4013.07 MB on both ranks: this rule gives 4012.28 MB, the
    previous one (fp32 partition and the copy in backward, bucket resident) 4842.43 MB."""
    p, s = 7_000_000_000, 8
    b = 2 if precision == "bf16" else 4
    options = layout("zero1", s, 1, mixed_precision=precision)
    zero1 = device_breakdown(profile(p, 500_000_000), options)
    assert zero1.item("gradients").bytes == b * p
    assert "communication_buffers" not in resident_keys("zero1", "none")
    resident = sum(zero1.item(key).bytes for key in ("parameters", "optimizer_states"))
    step = max(2 * b * p / s + (4 * p / s if b == 2 else 0), 4 * p / s + zero1.item("step_temporaries").bytes)
    bucket = b * 500_000_000
    # P > the bucket: the store from the second flush, and one more bucket-sized block a real run may still hold
    # from the previous step's reduction
    after_backward = bucket + b * p + (b * p / s - bucket) + bucket
    assert zero1.device_total_bytes == round(resident + max(step, after_backward))
    # a bucket larger than the model: one flush, at the end, its copy standing in for the gradients it moved
    huge = device_breakdown(profile(p, 500_000_000), layout("zero1", s, 1, mixed_precision=precision,
                                                           reduce_bucket_size=50_000_000_000))
    assert huge.device_total_bytes == resident + b * 50_000_000_000 + b * p
    # with overlap_comm the hooks reduce in backward as ZeRO-2's do: the same memory as ZeRO-2
    overlapped = device_breakdown(profile(p, 500_000_000), layout("zero1", s, 1, mixed_precision=precision, overlap_comm=True))
    zero2 = device_breakdown(profile(p, 500_000_000), layout("zero2", s, 1, mixed_precision=precision, overlap_comm=True))
    assert overlapped.device_total_bytes == zero2.device_total_bytes
    # offloaded (not read here from DeepSpeed's offload path), the bucket stays counted for the whole step
    assert "communication_buffers" in resident_keys("zero1", "optimizer")


def test_the_breakdown_says_where_zero12_hold_their_buckets():
    """The report's total line names what the arithmetic does: ZeRO-1's and ZeRO-2's bucket with backward (and the
    moment after it, each its own), not with the resident states; offloaded, the old line."""
    from prefect_accelerate.memory.report import render_breakdown

    zero2 = render_breakdown(device_breakdown(profile(), layout("zero2", 8, 1)))
    total = next(line for line in zero2.splitlines() if "Total per device" in line)
    resident, _, phases = total.partition("max(")
    assert "communication buffers" not in resident and "at the end of backward" in phases
    assert "made at each backward and released at its end" in zero2
    zero1 = render_breakdown(device_breakdown(profile(), layout("zero1", 8, 1)))
    total = next(line for line in zero1.splitlines() if "Total per device" in line)
    resident, _, phases = total.partition("max(")
    assert "communication buffers" not in resident and "gradients after backward" in phases
    assert "bucket reduction copy" not in phases  # its flushes come after backward, with the activations gone
    assert "(after backward)" in next(line for line in zero1.splitlines() if "Bucket reduction copy" in line)
    offloaded = render_breakdown(device_breakdown(profile(), layout("zero1", 8, 1, "optimizer")))
    total = next(line for line in offloaded.splitlines() if "Total per device" in line)
    assert "communication buffers" in total.partition("max(")[0] and "end of backward" not in total
