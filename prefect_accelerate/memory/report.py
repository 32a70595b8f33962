"""Text for people: the breakdown and the verdict as the CLI prints them, and rows for Prefect artifacts."""

from __future__ import annotations

from typing import Any

from prefect_accelerate.memory.models import DeviceBreakdown, FitVerdict, MemoryEstimate
from prefect_accelerate.memory.strategies import resident_keys, zero1_reduces_after_backward, zero_releases_its_bucket
from prefect_accelerate.memory.table import render_table
from prefect_accelerate.memory.units import human_bytes


def loading_line(estimate: MemoryEstimate) -> str:
    """Accelerate's first line, kept so that the table mode reads exactly like `accelerate estimate-memory`."""
    return f"Loading pretrained config for `{estimate.model}` from `{estimate.source.library}`..."


def render_text(estimate: MemoryEstimate, verdict: FitVerdict | None = None) -> str:
    parts = [loading_line(estimate), render_table(estimate.table)]
    if estimate.breakdown is not None:
        parts.append("")
        parts.append(render_breakdown(estimate.breakdown, estimate))
    if verdict is not None:
        parts.append("")
        parts.append(render_verdict(verdict))
    return "\n".join(parts)


def layout_line(b: DeviceBreakdown) -> str:
    machines = f"{b.num_machines} machines x {b.processes_per_machine}" if b.num_machines > 1 else f"{b.world_size}"
    shape = f"{b.batch_size} x {b.seq_len} tokens" if b.seq_len else f"{b.batch_size} sample(s)"
    pieces = [b.strategy, f"{machines} process(es), shard factor {b.shard_factor}",
              f"mixed precision {b.mixed_precision}", b.optimizer, f"offload {b.offload}", f"batch {shape}"]
    if b.gradient_checkpointing:
        pieces.append("gradient checkpointing")
    return ", ".join(pieces)


def render_breakdown(b: DeviceBreakdown, estimate: MemoryEstimate | None = None) -> str:
    head = (f"Per-device memory for training `{b.trained_class}` ({b.parameters:,} parameters: the class with its "
            "head, tied weights counted once)")
    if estimate is not None and estimate.table.measured_class != b.trained_class:
        head += f"; the table above measured `{estimate.table.measured_class}`, as Accelerate does"
    lines = [head, f"Layout: {layout_line(b)}"]
    if b.attention:
        lines.append(f"Attention: {b.attention} (as a CUDA device runs it; --attn_implementation changes it)")
    width = max(len(item.label) for item in [*b.device_items, *b.cpu_items])
    for item in b.device_items:
        lines.append(f"  {item.label:<{width}}  {item.human:>11}  {item.formula}")
    held = resident_keys(b.strategy, b.offload)
    resident = " + ".join(item.label.lower() for item in b.device_items if item.key in held)
    step = "optimizer step temporaries" if "gradients" in held else "gradients + optimizer step temporaries"
    # ZeRO's items held in forward and backward only (strategies.device_breakdown adds them there; ZeRO-2's reduce
    # bucket, made and released by each backward, too)
    # (ZeRO-1 reduces after backward by default: its copy comes when the activations are gone)
    after = zero1_reduces_after_backward(b.strategy, b.offload, b.overlap_comm)
    passing = "".join(f" + {item.label.lower()}" for item in b.device_items
                      if (item.key == "prefetch_buffer" or (item.key == "reduction_copy" and not after)
                          or (item.key == "communication_buffers" and item.key not in held)) and item.bytes)
    end = ""
    if zero_releases_its_bucket(b.strategy, b.offload):
        step = ("the step (the gradient partition, its flattened copy and fp32 copy; or the fp32 partition with the "
                "optimizer step temporaries)")
        end = (", communication buffers + gradients after backward (moved into the bucket and reduced; the partition "
               "store too when they outgrow one bucket)" if after else
               ", communication buffers + bucket reduction copy at the end of backward")
    lines.append(f"  {'Total per device':<{width}}  {b.device_total:>11}  peak: {resident} + max(activations + backward "
                 f"temporaries{passing}, {step} + outputs kept through the step{end}); live tensors, as "
                 "torch.cuda.max_memory_allocated counts them")
    lines.append(f"  {'All items added up':<{width}}  {human_bytes(b.all_items_bytes):>11}  an upper bound")
    lines.append(f"CPU memory per machine: {b.cpu_per_machine}")
    for item in b.cpu_items:
        lines.append(f"  {item.label:<{width}}  {item.human:>11}  {item.formula}")
    for note in b.notes:
        lines.append(f"Note: {note}")
    return "\n".join(lines)


def render_verdict(v: FitVerdict) -> str:
    lines = [v.message, f"Device memory: {v.device_memory} ({v.device_source}); counted: {v.counted}."]
    if v.reserve_explained and v.basis == "estimate":
        lines.append(f"Beyond the allocated peak: {v.reserve_explained}.")
    if v.unmodelled:
        lines.append(f"Not modelled: {'; '.join(v.unmodelled)}. 'Fits' then needs {v.margin_fraction:.0%} of the device free.")
    if v.measured is not None:
        lines.append(f"Measured: {v.measured.describe()}.")
    if not v.fits and len(v.suggestions) > 1:
        lines.append("Other changes that buy room:")
        lines.extend(f"  {s.change}  ->  {s.device_total} per device" for s in v.suggestions[1:])
    return "\n".join(lines)


def artifact_rows(estimate: MemoryEstimate) -> list[dict[str, Any]]:
    """Rows for a Prefect table artifact: Accelerate's table, then the per-device breakdown."""
    rows: list[dict[str, Any]] = [
        {"section": "accelerate", "item": f"{r.dtype}: largest layer / total / training using Adam",
         "value": f"{r.largest_layer} / {r.total} / {r.training}", "bytes": r.total_bytes, "formula": estimate.table.measured_class}
        for r in estimate.table.rows
    ]
    b = estimate.breakdown
    if b is not None:
        rows += [{"section": "per device", "item": i.label, "value": i.human, "bytes": i.bytes, "formula": i.formula}
                 for i in b.device_items]
        rows.append({"section": "per device", "item": "Total", "value": b.device_total, "bytes": b.device_total_bytes,
                     "formula": layout_line(b)})
        rows += [{"section": "cpu per machine", "item": i.label, "value": i.human, "bytes": i.bytes, "formula": i.formula}
                 for i in b.cpu_items]
    return rows
