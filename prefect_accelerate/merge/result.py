"""What a merge wrote: the result model returned by `merge_weights` and the `merge_weights` Prefect task."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from prefect_accelerate.merge.shards import format_size


class MergedTensor(BaseModel):
    """One tensor of the merged weights and the file it is in."""

    model_config = ConfigDict(frozen=True)

    name: str
    dtype: str
    shape: list[int]
    nbytes: int
    file: str


class MergeResult(BaseModel):
    """The merged weights: every tensor, the files written, and whether the source was removed."""

    model_config = ConfigDict(frozen=True)

    checkpoint_dir: Path
    output_dir: Path
    format: Literal["safetensors", "bin"]
    unwrapped_key: str | None = Field(description="the single top-level key that was dropped from names, e.g. 'model'")
    tensors: list[MergedTensor]
    objects: list[str] = Field(default_factory=list, description="non-tensor entries (kept in .bin files only)")
    total_bytes: int
    files: list[str] = Field(description="file names written in output_dir, the index last")
    index_file: str | None = None
    replaced_files: list[str] = Field(default_factory=list, description="older outputs of the same format removed")
    verified: bool = True
    optimizer_state: bool = Field(default=False, description="the checkpoint held optimizer state, written nested to a .bin")
    checkpoint_removed: bool = False
    duration_s: float

    @property
    def weights_path(self) -> Path:
        """What to load: the single weights file, or the index of a sharded one."""
        return self.output_dir / (self.index_file or self.files[0])

    def dtype_summary(self) -> dict[str, tuple[int, int]]:
        """dtype -> (number of tensors, bytes), largest first."""
        summary: dict[str, tuple[int, int]] = {}
        for t in self.tensors:
            count, size = summary.get(t.dtype, (0, 0))
            summary[t.dtype] = (count + 1, size + t.nbytes)
        return dict(sorted(summary.items(), key=lambda kv: -kv[1][1]))

    def message(self) -> str:
        dtypes = ", ".join(f"{dtype} x{count}" for dtype, (count, _) in self.dtype_summary().items())
        weight_files = [f for f in self.files if f != self.index_file]
        where = (
            f"{self.weights_path}"
            if self.index_file is None
            else f"{len(weight_files)} shards in {self.output_dir} (index {self.index_file})"
        )
        what = "optimizer state: " if self.optimizer_state else ""
        lines = [
            f"Merged {what}{len(self.tensors)} tensors ({dtypes}; {format_size(self.total_bytes)}) from {self.checkpoint_dir} "
            f"into {where} in {self.duration_s:.1f} s; every file was read back and checked."
        ]
        if self.objects:
            lines.append(f"Kept {len(self.objects)} non-tensor entries: {', '.join(self.objects[:5])}{' ...' if len(self.objects) > 5 else ''}.")
        if self.replaced_files:
            lines.append(f"Removed older output files of the same format: {', '.join(self.replaced_files)}.")
        if self.checkpoint_removed:
            lines.append(f"Removed the checkpoint folder {self.checkpoint_dir}.")
        return "\n".join(lines)

    def table_rows(self, limit: int | None = None) -> list[dict[str, str]]:
        """One row per tensor (name, dtype, shape, size, file) and a total row, for a table artifact."""
        shown = self.tensors if limit is None else self.tensors[:limit]
        rows = [
            {"tensor": t.name, "dtype": t.dtype, "shape": str(t.shape), "size": format_size(t.nbytes), "file": t.file}
            for t in shown
        ]
        if len(shown) < len(self.tensors):
            rest = self.tensors[len(shown):]
            rows.append({"tensor": f"... {len(rest)} more", "dtype": "", "shape": "", "size": format_size(sum(t.nbytes for t in rest)), "file": ""})
        rows.append({
            "tensor": f"total: {len(self.tensors)} tensors", "dtype": ", ".join(self.dtype_summary()), "shape": "",
            "size": format_size(self.total_bytes), "file": f"{len(self.files)} file(s)",
        })
        return rows
