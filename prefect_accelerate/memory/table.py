"""Accelerate's `estimate-memory` table: the same rows, numbers and box drawing (reference §5.5, §5.6).

Facts we keep: "Training using Adam" is computed on the float32 total before the row is scaled; it is
the largest of model, gradients, optimizer and step (4x the float32 size for float32, 2x for the 16-bit
types) and N/A for int8/int4. One thing we fix: Accelerate only scales the ``float16`` row by 2 and has
no ``bfloat16`` choice; our ``bfloat16`` row is scaled like ``float16`` (docs/memory.md).
"""

from __future__ import annotations

from prefect_accelerate.memory.choices import DTYPE_DIVISOR
from prefect_accelerate.memory.models import AccelerateTable, TableRow

HEADERS = ("dtype", "Largest Layer", "Total Size", "Training using Adam")


def training_usage(fp32_total: int | float, dtype: str) -> int | float | None:
    """Peak of Accelerate's four training figures (model, gradients, optimizer, step), batch size 1."""
    if dtype == "float32":
        # model 1x, gradients 1x, optimizer 2x, step 4x
        return fp32_total * 4
    if dtype in ("float16", "bfloat16"):
        # model 1x (fp32 master), gradients 1.5x, optimizer 2x, step = optimizer
        half = fp32_total // 2
        return max(fp32_total, fp32_total + half, fp32_total * 2)
    return None


def build_table(model_name: str, measured_class: str, total: int | float, largest: int | float,
                names: list[str], dtypes: tuple[str, ...]) -> AccelerateTable:
    rows = []
    for dtype in dtypes:
        training = training_usage(total, dtype)
        divisor = DTYPE_DIVISOR[dtype]
        # Accelerate divides with `/=` (a float) for every row but float32, which stays as counted
        row_total = total if divisor == 1 else total / divisor
        row_largest = largest if divisor == 1 else largest / divisor
        rows.append(TableRow.build(dtype, row_largest, row_total, training))
    return AccelerateTable(title=f"Memory Usage for loading `{model_name}`", measured_class=measured_class,
                           largest_layer_names=list(names), rows=rows)


def render_table(table: AccelerateTable) -> str:
    """Box-drawn like Accelerate's `create_ascii_table`, including its quirk with long titles.

    Columns are as wide as their widest cell, cells centred. When the title is longer than the
    columns' widths added up, Accelerate widens the last column by twice the difference between the
    title and the separator line (reference §5.6); we draw the same lines so the output is identical.
    """
    rows = [(r.dtype, r.largest_layer, r.total, r.training) for r in table.rows]
    widths = [max(len(cell) for cell in [HEADERS[i], *(row[i] for row in rows)]) for i in range(len(HEADERS))]
    if len(table.title) > sum(widths):
        inner = sum(widths) + len(widths) - 1
        widths[-1] += 2 * abs(len(table.title) - (inner + 2))
    inner = sum(widths) + len(widths) - 1

    def rule(left: str, middle: str, right: str) -> str:
        return left + middle.join("─" * width for width in widths) + right

    def cells(values: tuple[str, ...]) -> str:
        return "│" + "│".join(value.center(width) for value, width in zip(values, widths)) + "│"

    lines = ["┌" + "─" * inner + "┐", "│" + table.title.center(inner) + "│", rule("├", "┬", "┤"), cells(HEADERS),
             rule("├", "┼", "┤"), *(cells(row) for row in rows), rule("└", "┴", "┘")]
    return "\n".join(lines)
