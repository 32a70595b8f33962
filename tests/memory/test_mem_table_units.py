"""Byte formatting and the box-drawn table, against Accelerate's own helpers for any input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefect_accelerate.errors import UsageError
from prefect_accelerate.memory.models import AccelerateTable, TableRow
from prefect_accelerate.memory.table import render_table, training_usage
from prefect_accelerate.memory.units import accelerate_size, human_bytes, parse_memory_size


@pytest.fixture(scope="module")
def accelerate_helpers():
    pytest.importorskip("accelerate")
    from accelerate.commands.estimate import create_ascii_table, estimate_training_usage
    from accelerate.utils import convert_bytes

    return convert_bytes, create_ascii_table, estimate_training_usage


sizes = st.one_of(st.integers(0, 2**62), st.floats(0, 2**55, allow_nan=False))


@settings(max_examples=300, deadline=None)
@given(size=sizes)
def test_sizes_print_as_accelerate_prints_them(accelerate_helpers, size):
    convert_bytes, _, _ = accelerate_helpers
    assert accelerate_size(size) == convert_bytes(size)


@settings(max_examples=100, deadline=None)
@given(total=st.integers(0, 2**50), dtype=st.sampled_from(["float32", "float16", "bfloat16", "int8", "int4"]))
def test_training_usage_is_accelerates_peak(accelerate_helpers, total, dtype):
    _, _, estimate_training_usage = accelerate_helpers
    peak = max(estimate_training_usage(total, dtype).values())
    assert training_usage(total, dtype) == (None if peak == -1 else peak)


cells = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789. /", min_size=1, max_size=14)


@settings(max_examples=200, deadline=None)
@given(title=st.text(alphabet="abcdefghijklmnopqrstuvwxyz`/ -_.", min_size=0, max_size=140),
       rows=st.lists(st.tuples(cells, cells, cells, cells), min_size=1, max_size=5))
def test_table_is_drawn_exactly_like_accelerates(accelerate_helpers, title, rows):
    _, create_ascii_table, _ = accelerate_helpers
    headers = ["dtype", "Largest Layer", "Total Size", "Training using Adam"]
    table = AccelerateTable(title=title, measured_class="X", largest_layer_names=[], rows=[
        TableRow(dtype="float32", largest_layer_bytes=0, total_bytes=0, training_bytes=None,
                 largest_layer=r[1], total=r[2], training=r[3]) for r in rows])
    ours = render_table(table)
    theirs = create_ascii_table(headers, [["float32", r[1], r[2], r[3]] for r in rows], title)
    assert ours == theirs


def test_long_title_widens_the_last_column_as_accelerate_does(accelerate_helpers):
    _, create_ascii_table, _ = accelerate_helpers
    title = "Memory Usage for loading `" + "x" * 80 + "`"
    row = TableRow.build("float32", 9437184, 102441032, 4 * 102441032)
    table = AccelerateTable(title=title, measured_class="ResNet", largest_layer_names=[], rows=[row])
    drawn = render_table(table)
    assert drawn == create_ascii_table(["dtype", "Largest Layer", "Total Size", "Training using Adam"],
                                       [["float32", row.largest_layer, row.total, row.training]], title)
    assert len(drawn.splitlines()[-1]) > len(title)


def test_human_bytes_uses_binary_labels():
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(3 * 2**30) == "3.00 GiB"
    assert human_bytes(-2**20) == "-1.00 MiB"


@pytest.mark.parametrize("text,expected", [
    ("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("81920MiB", 80 * 2**30), ("1.5TiB", int(1.5 * 2**40)),
    ("2048", 2048), (" 24 gib ", 24 * 2**30), (4096, 4096),
])
def test_memory_sizes_parse(text, expected):
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "80 parsecs", "-1GiB", True, 0])
def test_bad_memory_sizes_are_refused(text):
    with pytest.raises(UsageError):
        parse_memory_size(text)
