"""The fit verdict: headroom against one device, and the smallest change that makes a run fit."""

from __future__ import annotations

import pytest

from prefect_accelerate.errors import EstimateError, UsageError
from prefect_accelerate.memory import EstimateOptions, check_fit, estimate
from prefect_accelerate.memory.fit import suggest
from prefect_accelerate.memory.models import ActivationProfile, ModelProfile
from prefect_accelerate.memory.strategies import device_breakdown

GiB = 2**30


@pytest.fixture(scope="module")
def gpt2_bf16(zoo):
    return estimate(str(zoo["gpt2"]), EstimateOptions(dtypes=("float32",), strategy="ddp", num_processes=4,
                                                      mixed_precision="bf16", batch_size=8, seq_len=1024))


def test_fits_with_headroom_after_the_reserve(gpt2_bf16):
    verdict = check_fit(gpt2_bf16, "80GiB")
    assert verdict.fits
    assert verdict.usable_bytes == int(80 * GiB * 0.9)
    assert verdict.headroom_bytes == verdict.usable_bytes - gpt2_bf16.breakdown.device_total_bytes
    assert verdict.suggestions == []
    assert verdict.message.startswith("Fits:")


def test_does_not_fit_and_names_the_smallest_change_first(gpt2_bf16):
    verdict = check_fit(gpt2_bf16, "24GiB")
    assert not verdict.fits and verdict.headroom_bytes < 0
    assert verdict.best.change == "--gradient_checkpointing"
    assert "Smallest change that fits: --gradient_checkpointing" in verdict.message
    for suggestion in verdict.suggestions:
        assert suggestion.device_total_bytes <= verdict.usable_bytes
        assert device_breakdown(gpt2_bf16.profile, suggestion.options).device_total_bytes == suggestion.device_total_bytes


def test_a_smaller_batch_is_the_largest_batch_that_fits(gpt2_bf16):
    verdict = check_fit(gpt2_bf16, "24GiB")
    batch = next(s for s in verdict.suggestions if s.change.startswith("--batch_size"))
    size = batch.options.batch_size
    bigger = device_breakdown(gpt2_bf16.profile, batch.options.model_copy(update={"batch_size": size + 1}))
    assert bigger.device_total_bytes > verdict.usable_bytes


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
    verdict = check_fit(gpt2_bf16, "1MiB")  # smaller than one layer's activations: no change can fit
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
