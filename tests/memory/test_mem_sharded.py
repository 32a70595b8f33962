"""The estimate for sharded layouts against the real layout: DDP, FSDP (FULL_SHARD), DeepSpeed ZeRO-2 (bf16) and ZeRO-3
(a small reduce bucket, so more than the bucket shows) with
2 processes under torch.distributed.run (gloo, CPU, loopback), each rank's own allocator peak
(bench/memory_sharded_cpu.py).
The probe (`--measure`) runs one process and cannot see a sharded layout; this holds the estimate's
bookkeeping for one rank (shards, gathered units, DDP's buckets) to what real processes hold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "memory_sharded_cpu.py"

pytestmark = pytest.mark.slow


def _layouts(out, *layouts, precision="no", zero=()):
    done = subprocess.run([sys.executable, str(BENCH), "--repeats", "1", *(f"--only={name}" for name in layouts),
                           "--mixed_precision", precision, *zero, "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = {row["layout"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == sorted(layouts)
    return rows


def _held_to_the_estimate(layout, row):
    """No rank's peak more than 10% above the estimate, leaving out the copies gloo makes inside its collectives
    (NCCL makes none in PyTorch's allocator), nor 25% above it with them: gloo's `_reduce_scatter_base_` clones its
    whole input and the clone can live on into the next forward, for as long as gloo's threads keep it (Mixtral's
    FULL_SHARD reached 1.16x whole, 0.862, in a suite run on two busy workers, while it held 0.90-1.15 without
    gloo's copies). Below the estimate by at most 15%: the estimate holds what comes and goes with timing at its
    most (ZeRO-3's prefetch bucket is the whole model here, 11% of a rank's peak, and some runs peak while less of
    it is in flight; docs/memory.md, "On CPU: the real process layout"), so a modelling error shows, run-to-run
    timing does not."""
    assert len(row["rank_peaks"]) == len(row["rank_peaks_outside_collectives"]) == 2
    for peak, outside in zip(row["rank_peaks"], row["rank_peaks_outside_collectives"]):
        assert 0.90 <= row["estimate"] / outside <= 1.15, (layout, row)
        assert row["estimate"] / peak >= 1 / 1.25, (layout, row)


def test_each_ranks_real_peak_under_ddp_and_fsdp_is_held_to_the_estimate(tmp_path):
    rows = _layouts(tmp_path / "sharded.jsonl", "ddp", "fsdp_full_shard")
    for layout, row in rows.items():
        _held_to_the_estimate(layout, row)
    # sharding saves what the estimate says it saves, in the real run too
    assert max(rows["fsdp_full_shard"]["rank_peaks"]) < min(rows["ddp"]["rank_peaks"])
    assert rows["fsdp_full_shard"]["estimate"] < rows["ddp"]["estimate"]


def test_deepspeeds_zero2_holds_its_whole_reduce_bucket_on_each_rank_as_estimated(tmp_path):
    """DeepSpeed allocates its 5e8-element reduce bucket whole: a 3M-parameter model needs 1 GB per rank in bf16
    (the estimate said 0.06 GB while it counted min(P, 5e8))."""
    row = _layouts(tmp_path / "zero.jsonl", "zero2", precision="bf16")["zero2"]
    assert all(peak > 10**9 for peak in row["rank_peaks"])  # the bucket: 5e8 x 2 B
    _held_to_the_estimate("zero2", row)


def test_deepspeeds_zero3_holds_what_its_coordinator_keeps_gathered_and_in_flight(tmp_path):
    """With a 2e6-element reduce bucket the rest of a ZeRO-3 rank shows: weights kept gathered within the reuse
    distance, the prefetch bucket's flat buffer beside the weights copied out of it, the resident gradient partition
    (each of them once 0.70-0.95 of the peak before the estimate counted it)."""
    row = _layouts(tmp_path / "zero3.jsonl", "zero3", zero=("--reduce_bucket_size", "2000000", "--overlap_comm", "on"))["zero3"]
    _held_to_the_estimate("zero3", row)


def test_a_mixture_of_experts_family_nobody_tuned_the_sharded_estimate_to_is_held_to_it_too(tmp_path):
    """Mixtral (experts inside each decoder block, a router, grouped keys/values), from its own family defaults at
    a tiny width (bench/memory_families_cpu.py's config), wrapped as Accelerate wraps it: one FSDP unit per class in
    its `_no_split_modules`. The Llama rows above never saw experts; docs/data/memory_sharded_families_cpu.jsonl
    has six families under all six layouts."""
    done = subprocess.run([sys.executable, str(BENCH), "--repeats", "1", "--family", "mixtral", "--only=fsdp_full_shard",
                           "--out", str(tmp_path / "family.jsonl")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    [row] = map(json.loads, (tmp_path / "family.jsonl").read_text().splitlines())
    assert row["family"] == "mixtral" and row["layout"] == "fsdp_full_shard"
    _held_to_the_estimate("fsdp_full_shard", row)
