"""Artifacts written for a person reading them in Prefect's UI: one per gate, one summary per run.

Rendering is plain text building (no Prefect); `publish` files an artifact under a task run, which lets
the pipeline attach a cached step's artifact to the cached task run of the run that used it: a user
looking at one run sees everything that gated it, whether the step ran or came from the cache.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from prefect_accelerate.memory.models import FitVerdict, MemoryEstimate
from prefect_accelerate.memory.units import human_bytes
from prefect_accelerate.pipeline.steps import device_source_text


def publish(key: str, *, markdown: str | None = None, table: list[dict[str, Any]] | None = None, description: str = "",
            task_run_id: UUID | None = None) -> None:
    """A markdown or table artifact under `key`, attached to `task_run_id` (else to the current run)."""
    from prefect.artifacts import MarkdownArtifact, TableArtifact

    if table is not None:
        TableArtifact(key=key, table=table, description=description, task_run_id=task_run_id).create()
    else:
        MarkdownArtifact(key=key, markdown=markdown or "", description=description, task_run_id=task_run_id).create()


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def fit_summary(verdict: FitVerdict) -> str:
    """The summary row's reason: `fits: 261.0 MiB of 14.4 GiB usable`."""
    word = "fits" if verdict.fits else "does not fit"
    return f"{word}: {verdict.required} of {human_bytes(verdict.usable_bytes)} usable"


def verdict_markdown(verdict: FitVerdict) -> str:
    head = "## Memory fit: fits" if verdict.fits else "## Memory fit: does NOT fit"
    lines = [head, "", verdict.message, "", "| | |", "|---|---|",
             f"| needed per device | {verdict.required} |",
             f"| device memory | {verdict.device_memory}, from {device_source_text(verdict.device_source)} |",
             f"| usable | {human_bytes(verdict.usable_bytes)} (after a {verdict.reserve_fraction:.0%} reserve) |",
             f"| headroom | {verdict.headroom} |",
             f"| counted | {_cell(verdict.counted)} |"]
    if not verdict.fits and len(verdict.suggestions) > 1:
        lines += ["", "Other changes that fit:", "", "| change | per device |", "|---|---|"]
        lines += [f"| {_cell(s.change)} | {s.device_total} |" for s in verdict.suggestions[1:]]
    return "\n".join(lines)


def estimate_markdown(estimate: MemoryEstimate) -> str:
    """The estimate, compact: the model once, the per-device breakdown with its total first, then Accelerate's
    table in the same binary units."""
    source = estimate.source
    lines = [f"## Memory estimate: `{source.name}`", "", f"Read from {source.kind} `{source.location}` ({source.library})."]
    b = estimate.breakdown
    if b is not None:
        from prefect_accelerate.memory.report import layout_line

        lines += ["", f"**{b.device_total} per device** for training `{b.trained_class}` ({b.parameters:,} parameters).",
                  f"Layout: {layout_line(b)}.", "", "| per device | size | how |", "|---|---:|---|"]
        lines += [f"| {i.label} | {human_bytes(i.bytes)} | {_cell(i.formula)} |" for i in b.device_items if i.bytes]
        lines.append(f"| **total (peak)** | **{human_bytes(b.device_total_bytes)}** | parameters + optimizer states + gathered "
                     "layers + buffers + the larger of the forward/backward and optimizer-step phases |")
        if b.cpu_items:
            lines += ["", f"CPU memory per machine: {b.cpu_per_machine}."]
        lines += [f"Note: {note}" for note in b.notes]
    table = estimate.table
    lines += ["", f"Accelerate's table (`{table.measured_class}`, as `accelerate estimate-memory` measures it):", "",
              "| dtype | largest layer | total | training with Adam |", "|---|---:|---:|---:|"]
    for row in table.rows:
        training = human_bytes(row.training_bytes) if row.training_bytes is not None else "n/a"
        lines.append(f"| {row.dtype} | {human_bytes(row.largest_layer_bytes)} | {human_bytes(row.total_bytes)} | {training} |")
    return "\n".join(lines)


def config_markdown(check: Any) -> str:
    lines = ["## Config", "", "| | |", "|---|---|",
             f"| file | `{check.config_path}` ({check.config_source}) |" if check.config_path else "| file | none: launch flags only |",
             f"| launcher | {check.launcher} |", f"| processes | {check.num_processes} on {check.num_machines} machine(s) |",
             f"| mixed precision | {check.mixed_precision} |"]
    lines += [f"| note | {_cell(n)} |" for n in check.notes] + [f"| warning | {_cell(w)} |" for w in check.warnings]
    return "\n".join(lines)


def deepspeed_markdown(check: Any) -> str:
    lines = ["## DeepSpeed check: " + ("ok" if check.ok else "FAILED"), "", "| | |", "|---|---|",
             f"| version | {check.version or 'not installed'} |", f"| accelerator | {check.accelerator or '-'} |",
             f"| backend | {check.communication_backend or '-'} |"]
    if check.memory is not None:
        lines.append(f"| ZeRO-{check.memory.zero_stage} model states | {human_bytes(check.memory.per_device_bytes)} per device, "
                     f"{human_bytes(check.memory.per_node_cpu_bytes)} CPU per machine |")
    lines += [f"| problem | {_cell(p)} |" for p in check.problems] + [f"| note | {_cell(n)} |" for n in check.notes]
    return "\n".join(lines)
