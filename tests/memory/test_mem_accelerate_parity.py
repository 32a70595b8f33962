"""Our table against Accelerate 1.16.0 itself (a test-only oracle): same numbers, same text.

Accelerate's `estimate-memory` always asks the Hub first (reference §5.1), so the oracle runs with
`verify_on_hub` replaced by the answer the Hub would give (library name and config metadata); the
model is then built by Accelerate's own code from the same local config.
"""

from __future__ import annotations

import contextlib
import io
import json
import types

import pytest

from prefect_accelerate.memory import EstimateOptions, estimate
from prefect_accelerate.memory.report import loading_line
from prefect_accelerate.memory.table import render_table

ACCELERATE_DTYPES = ["float32", "float16", "int8", "int4"]


@pytest.fixture(scope="module")
def oracle():
    pytest.importorskip("accelerate")
    import accelerate

    if accelerate.__version__ != "1.16.0":
        pytest.skip(f"the parity oracle is accelerate 1.16.0, found {accelerate.__version__}")
    import accelerate.commands.estimate as accelerate_estimate

    return accelerate_estimate


def run_oracle(oracle, monkeypatch, name: str, library: str, config: dict | None = None):
    monkeypatch.setattr(oracle, "verify_on_hub",
                        lambda repo, token=None: types.SimpleNamespace(library_name=library, config=config or {}))
    args = oracle.estimate_command_parser().parse_args([name, "--library_name", library, "--dtypes", *ACCELERATE_DTYPES])
    data = oracle.gather_data(args)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        oracle.estimate_command(args)
    return data, printed.getvalue().rstrip("\n")


def assert_same(ours, data, printed):
    for row, (dtype, largest, total, training) in zip(ours.table.rows, data, strict=True):
        assert row.dtype == dtype
        assert (row.largest_layer_bytes, type(row.largest_layer_bytes)) == (largest, type(largest))
        assert (row.total_bytes, type(row.total_bytes)) == (total, type(total))
        peak = max(training.values())
        assert row.training_bytes == (None if peak == -1 else peak)
    assert loading_line(ours) + "\n" + render_table(ours.table) == printed


@pytest.mark.parametrize("name", ["bert-base-cased", "gpt2", "t5", "llama-3-70b", "mixtral", "vit"])
def test_transformers_table_matches_accelerate(name, zoo, oracle, monkeypatch):
    folder = str(zoo[name])
    data, printed = run_oracle(oracle, monkeypatch, folder, "transformers", json.loads((zoo[name] / "config.json").read_text()))
    ours = estimate(folder, EstimateOptions(dtypes=tuple(ACCELERATE_DTYPES)))
    assert_same(ours, data, printed)


@pytest.mark.parametrize("arch", ["resnet50", "vit_small_patch16_224"])
def test_timm_architecture_table_matches_accelerate(arch, oracle, monkeypatch):
    data, printed = run_oracle(oracle, monkeypatch, arch, "timm")
    ours = estimate(arch, EstimateOptions(dtypes=tuple(ACCELERATE_DTYPES)))
    assert ours.source.kind == "timm"
    assert_same(ours, data, printed)


def test_timm_repo_in_the_hf_cache_matches_accelerate(cache_entry, timm_resnet50_config, oracle, monkeypatch):
    cache_entry("timm/resnet50.a1_in1k", timm_resnet50_config)
    data, printed = run_oracle(oracle, monkeypatch, "timm/resnet50.a1_in1k", "timm")
    ours = estimate("timm/resnet50.a1_in1k", EstimateOptions(dtypes=tuple(ACCELERATE_DTYPES)))
    assert ours.source.kind == "hf-cache"
    assert_same(ours, data, printed)


def test_bert_base_cased_reproduces_accelerates_published_figures(zoo):
    row = estimate(str(zoo["bert-base-cased"]), EstimateOptions(dtypes=("float32",))).table.rows[0]
    assert (row.largest_layer_bytes, row.total_bytes) == (90669056, 433249280)
    assert row.training_bytes == 4 * 433249280


def test_timm_resnet50_reproduces_accelerates_published_figures(zoo):
    ours = estimate(str(zoo["timm-resnet50"]), EstimateOptions(dtypes=("float32", "float16")))
    assert ours.source.library == "timm"
    float32, float16 = ours.table.rows
    assert (float32.largest_layer_bytes, float32.total_bytes) == (9437184, 102441032)
    assert float16.training_bytes == 4 * float16.total_bytes  # Accelerate's test: training = 4 x the 16-bit size


def test_t5_table_counts_the_shared_embedding_three_times_as_accelerate_does(zoo):
    ours = estimate(str(zoo["t5"]), EstimateOptions(dtypes=("float32",), strategy="ddp", activations=False))
    shared = 32128 * 512 * 4
    assert ours.table.rows[0].total_bytes - 4 * ours.profile.parameters == 2 * shared
    assert ours.breakdown.trained_class == "T5ForConditionalGeneration"


def test_bfloat16_row_is_scaled_like_float16(zoo):
    rows = estimate(str(zoo["gpt2"]), EstimateOptions(dtypes=("float16", "bfloat16"))).table.rows
    assert rows[0].model_dump(exclude={"dtype"}) == rows[1].model_dump(exclude={"dtype"})
