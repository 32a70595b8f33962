"""The estimate against memory measured on real GPUs (tests/data/memory_gpu_*.json), checked without a GPU.

Each committed case is a training run measured with torch.cuda.max_memory_allocated (provenance in the
file). The estimate for the same run, made here on CPU, must be within 10% of the allocated peak; a run
that ran out of memory must never be called "Fits" on its device.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from prefect_accelerate.memory import check_fit, estimate
from prefect_accelerate.memory.measured import GIB, case_options, load_cases, write_config

DATA = sorted((Path(__file__).resolve().parent.parent / "data").glob("memory_gpu_*.json"))
CASES = [(path.name, provenance, case) for path in DATA for provenance, cases in [load_cases(path)] for case in cases]
TOLERANCE = 0.10


def _id(item: tuple) -> str:
    return f"{item[0]}:{item[2]['name']}"


@pytest.fixture(scope="module")
def estimates(tmp_path_factory):
    made: dict[str, object] = {}

    def get(file: str, case: dict):
        key = f"{file}:{case['name']}"
        if key not in made:
            folder = write_config(case, tmp_path_factory.mktemp("gpu-case"))
            made[key] = estimate(str(folder), case_options(case))
        return made[key]

    return get


def test_measurements_are_committed_with_provenance():
    assert CASES, "no tests/data/memory_gpu_*.json"
    for _, provenance, _case in CASES:
        for field in ("gpu", "device_memory_gib", "torch", "transformers", "loop", "source"):
            assert provenance.get(field), field


@pytest.mark.parametrize("item", [c for c in CASES if c[2]["outcome"] == "ok"], ids=_id)
def test_estimate_is_within_10_percent_of_the_measured_allocated_peak(estimates, item):
    file, _, case = item
    result = estimates(file, case)
    ratio = result.breakdown.device_total_bytes / (case["allocated_peak_gib"] * GIB)
    assert 1 - TOLERANCE <= ratio <= 1 + TOLERANCE, f"{case['name']}: estimate / measured = {ratio:.3f}"


@pytest.mark.parametrize("item", [c for c in CASES if c[2]["outcome"] == "ok" and c[2].get("reserved_peak_gib")], ids=_id)
def test_allocator_need_covers_the_measured_reserved_peak(estimates, item):
    file, provenance, case = item
    verdict = check_fit(estimates(file, case), int(provenance["device_memory_gib"] * GIB))
    reserved = case["reserved_peak_gib"] * GIB
    assert verdict.required_bytes >= reserved * 0.95, f"{case['name']}: need {verdict.required} < reserved {reserved / GIB:.2f} GiB"


@pytest.mark.parametrize("item", [c for c in CASES if c[2]["outcome"] == "out of memory"], ids=_id)
def test_a_run_that_ran_out_of_memory_is_never_called_fits(estimates, item):
    file, provenance, case = item
    result = estimates(file, case)
    verdict = check_fit(result, int(provenance["device_memory_gib"] * GIB))
    assert not verdict.fits and verdict.status in ("at risk", "does not fit")
    assert not verdict.message.startswith("Fits")
    # the allocator had this much allocated when it failed: what we say it needs is at least that
    assert verdict.required_bytes >= case["allocated_at_failure_gib"] * GIB
    # and the allocated peak we estimate is within 10% of the lower bound the failure gives
    lower_bound = case["allocated_at_failure_gib"] * GIB + case["failed_allocation_mib"] * 2**20
    assert result.breakdown.device_total_bytes >= lower_bound * (1 - TOLERANCE)


def test_the_attention_that_ran_is_the_one_modelled(estimates):
    by_name = {case["name"]: (file, case) for file, _, case in CASES}
    gpt2_default = estimates(*by_name["gpt2-medium fp32 8x1024 sdpa (default)"])
    gpt2_eager = estimates(*by_name["gpt2-medium fp32 8x1024 eager"])
    llama_fp32 = estimates(*by_name["llama-1.1b-shape fp32 4x1024"])
    llama_bf16 = estimates(*by_name["llama-1.1b-shape bf16 4x1024"])
    assert gpt2_default.breakdown.attention == "sdpa (CUDA kernel: efficient)"
    assert gpt2_eager.breakdown.attention == "eager"
    # grouped keys/values in fp32: no fused kernel takes them, so CUDA runs the math path (seq x seq kept)
    assert llama_fp32.breakdown.attention == "sdpa (CUDA kernel: math)"
    assert llama_bf16.breakdown.attention == "sdpa (CUDA kernel: flash)"
