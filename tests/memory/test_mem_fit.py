"""The fit verdict: headroom against one device, and the smallest change that makes a run fit."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefect_accelerate.errors import EstimateError, UsageError
from prefect_accelerate.memory import EstimateOptions, check_fit, estimate
from prefect_accelerate.memory.fit import ALLOCATOR_FRAGMENTATION, AT_RISK_FRACTION, CUDA_CONTEXT_BYTES, suggest
from prefect_accelerate.memory.models import ActivationProfile, ModelProfile
from prefect_accelerate.memory.strategies import device_breakdown

GiB = 2**30


@pytest.fixture(scope="module")
def gpt2_bf16(zoo):
    return estimate(str(zoo["gpt2"]), EstimateOptions(dtypes=("float32",), strategy="ddp", num_processes=4,
                                                      mixed_precision="bf16", batch_size=8, seq_len=1024))


def test_fits_with_headroom_after_the_allocator_overhead(gpt2_bf16):
    verdict = check_fit(gpt2_bf16, "24GiB")
    allocated = gpt2_bf16.breakdown.device_total_bytes
    assert verdict.fits and verdict.status == "fits"
    assert verdict.allocated_peak_bytes == allocated
    assert verdict.allocator_overhead_bytes == CUDA_CONTEXT_BYTES + int(allocated * ALLOCATOR_FRAGMENTATION)
    assert verdict.required_bytes == allocated + verdict.allocator_overhead_bytes
    assert verdict.usable_bytes == 24 * GiB
    assert verdict.headroom_bytes == verdict.usable_bytes - verdict.required_bytes
    assert verdict.suggestions == []
    assert verdict.message.startswith("Fits:")
    assert "CUDA context" in verdict.reserve_explained and "fragmentation" in verdict.reserve_explained


def test_a_user_reserve_is_kept_back_on_top(gpt2_bf16):
    verdict = check_fit(gpt2_bf16, "24GiB", reserve_fraction=0.25)
    assert verdict.usable_bytes == int(24 * GiB * 0.75)
    assert verdict.headroom_bytes == verdict.usable_bytes - verdict.required_bytes


def test_does_not_fit_and_names_the_smallest_change_first(gpt2_bf16):
    verdict = check_fit(gpt2_bf16, "12GiB")
    assert not verdict.fits and verdict.status == "does not fit" and verdict.headroom_bytes < 0
    assert verdict.best.change == "--gradient_checkpointing"
    assert "Smallest change that buys room: --gradient_checkpointing" in verdict.message
    for suggestion in verdict.suggestions:
        # each suggestion clears the at-risk line once the allocator overhead is added
        need = suggestion.device_total_bytes * (1 + ALLOCATOR_FRAGMENTATION) + CUDA_CONTEXT_BYTES
        assert need <= verdict.device_memory_bytes * (1 - AT_RISK_FRACTION)
        assert device_breakdown(gpt2_bf16.profile, suggestion.options).device_total_bytes == suggestion.device_total_bytes


def test_a_thin_margin_is_at_risk_not_fits_and_names_a_change(gpt2_bf16):
    need = check_fit(gpt2_bf16, "24GiB").required_bytes
    verdict = check_fit(gpt2_bf16, int(need / 0.97))  # 3% of the device left
    assert verdict.status == "at risk" and not verdict.fits and verdict.headroom_bytes > 0
    assert verdict.message.startswith("At risk:") and "Smallest change that buys room:" in verdict.message
    assert verdict.suggestions


@given(device_gib=st.floats(min_value=0.5, max_value=200), reserve=st.floats(min_value=0, max_value=0.5))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_never_fits_when_it_needs_more_than_the_device(gpt2_bf16, device_gib, reserve):
    verdict = check_fit(gpt2_bf16, int(device_gib * GiB), reserve_fraction=reserve)
    if verdict.required_bytes > verdict.device_memory_bytes * (1 - reserve):
        assert verdict.status == "does not fit" and not verdict.fits and not verdict.message.startswith("Fits")
    if verdict.fits:
        assert verdict.headroom_bytes >= AT_RISK_FRACTION * verdict.device_memory_bytes


def test_a_smaller_batch_is_the_largest_batch_that_fits(gpt2_bf16):
    verdict = check_fit(gpt2_bf16, "12GiB")
    batch = next(s for s in verdict.suggestions if s.change.startswith("--batch_size"))
    size = batch.options.batch_size
    bigger = device_breakdown(gpt2_bf16.profile, batch.options.model_copy(update={"batch_size": size + 1}))
    assert check_fit(gpt2_bf16.model_copy(update={"breakdown": bigger}), "12GiB").status != "fits"
    smaller = device_breakdown(gpt2_bf16.profile, batch.options)
    assert check_fit(gpt2_bf16.model_copy(update={"breakdown": smaller}), "12GiB").status == "fits"


def test_model_states_too_big_for_ddp_suggest_sharding_or_offload():
    profile = ModelProfile(trained_class="Big", parameters=7_000_000_000, trainable_parameters=7_000_000_000, buffer_bytes=0,
                           largest_tensor_numel=500_000_000, small_tensor_numel=0, adafactor_state_numel=10**8,
                           largest_module_parameters=500_000_000, largest_unit_parameters=200_000_000,
                           root_unit_parameters=1_000_000_000,
                           activations=ActivationProfile(method="traced", batch_size=1, input_description="x",
                                                         precision_mode="bf16", saved_bytes=2 * GiB, largest_tensor_bytes=10**8))
    options = EstimateOptions(strategy="ddp", num_processes=8, mixed_precision="bf16")
    changes = [s.change for s in suggest(profile, options, int(80 * GiB * 0.9))]
    assert changes and all(c.startswith(("--strategy", "--optimizer", "--num_processes")) or "--strategy" in c for c in changes)
    assert changes[0] in ("--strategy zero1", "--strategy zero2", "--strategy fsdp_shard_grad_op", "--strategy zero3")


def test_nothing_fits_says_so(gpt2_bf16):
    verdict = check_fit(gpt2_bf16, "1MiB")  # smaller than the CUDA context alone: no change can fit
    assert not verdict.fits and verdict.suggestions == []
    assert "None of the changes we try" in verdict.message and "GiB short" in verdict.message


def test_estimate_without_breakdown_cannot_be_judged(zoo):
    table_only = estimate(str(zoo["tiny-gpt2"]), EstimateOptions(dtypes=("float32",)))
    with pytest.raises(EstimateError, match="no per-device breakdown"):
        check_fit(table_only, "80GiB")


def test_no_device_memory_and_no_cuda_asks_for_the_flag(gpt2_bf16, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EstimateError, match="--device_memory 80GiB"):
        check_fit(gpt2_bf16)


def test_detected_devices_use_the_smallest_one(gpt2_bf16, monkeypatch):
    import types

    import torch

    sizes = [80 * GiB, 40 * GiB]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=sizes[i], name="GPU"))
    verdict = check_fit(gpt2_bf16)
    assert verdict.device_memory_bytes == 40 * GiB
    assert verdict.device_source.startswith("detected: 2 x GPU")


@pytest.mark.parametrize("bad", ["eighty", "80XB", "-5GiB", "0"])
def test_bad_device_memory_is_a_usage_error(gpt2_bf16, bad):
    with pytest.raises(UsageError):
        check_fit(gpt2_bf16, bad)
