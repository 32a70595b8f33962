"""Which output file each tensor goes to: one file, or shards with an index, as transformers' save_pretrained does.

The split is huggingface_hub's (`split_torch_state_dict_into_shards`): walk the tensors in order, start a
new shard when the next one would push the current shard over the limit, and give a tensor larger than
the limit a shard of its own. Names and index follow the same convention, so `from_pretrained` and
`huggingface_hub` read the result: `model-00001-of-00003.safetensors` and `model.safetensors.index.json`
holding `{"metadata": {"total_size": ...}, "weight_map": {name: file}}`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from prefect_accelerate.errors import UsageError
from prefect_accelerate.merge.checkpoint import CheckpointEntry

OutputFormat = Literal["safetensors", "bin"]

#: transformers' save_pretrained default (transformers 5); Accelerate itself never shards
DEFAULT_MAX_SHARD_SIZE = "50GB"
WEIGHTS_NAMES: dict[str, str] = {"safetensors": "model.safetensors", "bin": "pytorch_model.bin"}
INDEX_NAMES: dict[str, str] = {"safetensors": "model.safetensors.index.json", "bin": "pytorch_model.bin.index.json"}
_PATTERNS = {"safetensors": "model{suffix}.safetensors", "bin": "pytorch_model{suffix}.bin"}
_FAMILY = {
    "safetensors": re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$"),
    "bin": re.compile(r"^pytorch_model(-\d{5}-of-\d{5})?\.bin(\.index\.json)?$"),
}
_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


@dataclass(frozen=True)
class OutputFile:
    name: str
    entries: tuple[CheckpointEntry, ...]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


def parse_size(size: str | int) -> int:
    """Bytes in a size like "5GB" (10**9), "500MB", "2GiB" (2**30) or a plain number of bytes.

    Raises:
        UsageError: not a positive size.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = _SIZE_RE.match(str(size))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise UsageError(
                f"--max_shard_size {size!r} is not a size. Write a number with a unit, e.g. `5GB`, `500MB` or `2GiB` "
                "(KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024), or a number of bytes."
            )
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UsageError(f"--max_shard_size must be more than 0 bytes, got {size!r}; e.g. `5GB`.")
    return value


def format_size(nbytes: float) -> str:
    """Decimal units, matching the sizes --max_shard_size takes: "704 B", "1.23 MB", "5.00 GB"."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


def plan_files(entries: Sequence[CheckpointEntry], fmt: OutputFormat, max_shard_bytes: int) -> list[OutputFile]:
    """Split the entries into output files in checkpoint order; one file named `model.safetensors` when they fit."""
    shards: list[list[CheckpointEntry]] = []
    current: list[CheckpointEntry] = []
    current_size = 0
    for entry in entries:
        if entry.nbytes > max_shard_bytes:
            shards.append([entry])
            continue
        if current and current_size + entry.nbytes > max_shard_bytes:
            shards.append(current)
            current, current_size = [], 0
        current.append(entry)
        current_size += entry.nbytes
    if current or not shards:
        shards.append(current)
    pattern = _PATTERNS[fmt]
    if len(shards) == 1:
        return [OutputFile(pattern.format(suffix=""), tuple(shards[0]))]
    count = len(shards)
    return [OutputFile(pattern.format(suffix=f"-{i:05d}-of-{count:05d}"), tuple(s)) for i, s in enumerate(shards, 1)]


def index_json(files: Sequence[OutputFile]) -> str:
    """The index transformers and huggingface_hub read for a sharded checkpoint (sorted keys, 2-space indent)."""
    weight_map = {e.name: f.name for f in files for e in f.entries}
    index = {"metadata": {"total_size": sum(f.nbytes for f in files)}, "weight_map": weight_map}
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


def is_own_output(filename: str, fmt: OutputFormat) -> bool:
    """True for the files a merge to this format writes (single, shard or index), so stale ones can be removed."""
    return bool(_FAMILY[fmt].match(filename))
