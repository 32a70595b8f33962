"""The safetensors file format, written as a stream so a merge never holds the whole model in memory.

A safetensors file is an 8-byte little-endian header length, a JSON header (`__metadata__`, then for each
tensor its dtype, shape and byte range), padded with spaces to a multiple of 8, then the raw tensor bytes
back to back. The header only needs names, dtypes and shapes, which `.metadata` gives before any tensor
is read, so we write the header first and then each tensor as it is loaded. The layout follows the
`safetensors` library (tensors ordered by dtype alignment, largest first, then by name), so for the same
tensors the file is byte-for-byte what `safetensors.torch.save_file` writes (tests check this).
"""

from __future__ import annotations

import json
import os
import struct
import sys
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from prefect_accelerate.errors import MergeError

#: torch dtype name -> safetensors dtype code (safetensors 0.4+)
SAFETENSORS_DTYPES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ", "complex64": "C64",
}
#: the order the safetensors library lays dtypes out in (its dtype enum, descending): keeps every tensor
#: aligned to its element size, and our files identical to the library's
_LAYOUT_ORDER = (
    "U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16",
    "F8_E5M2FNUZ", "F8_E4M3FNUZ", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL",
)
_RANK = {code: rank for rank, code in enumerate(_LAYOUT_ORDER)}
_ALIGN = 8
_READ_CHUNK = 64 << 20


@dataclass(frozen=True)
class TensorSpec:
    """What the header says about one tensor."""

    name: str
    dtype: str  # torch dtype name
    shape: tuple[int, ...]
    nbytes: int

    @property
    def code(self) -> str:
        return SAFETENSORS_DTYPES[self.dtype]


def unsupported_dtypes(dtypes: Iterable[str]) -> list[str]:
    return sorted({d for d in dtypes if d not in SAFETENSORS_DTYPES})


def file_order(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    """The order tensors are stored in: by dtype alignment, then by name (byte order, as Rust sorts)."""
    return sorted(specs, key=lambda s: (_RANK[s.code], s.name.encode("utf-8")))


def build_header(specs: list[TensorSpec], metadata: dict[str, str] | None) -> bytes:
    """The header bytes (length prefix included) for tensors already in `file_order`."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": spec.code, "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % _ALIGN)
    return struct.pack("<Q", len(text)) + text


def tensor_bytes(tensor: Any) -> memoryview:
    """A tensor's bytes in memory order (little-endian on the machines torch supports), without a copy when contiguous."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def checksum(data: memoryview | bytes, value: int = 0) -> int:
    return zlib.crc32(data, value)


class SafetensorsWriter:
    """Write one safetensors file: header now, then each tensor in `file_order`, checksummed as it goes.

    Example:
        >>> with SafetensorsWriter(path, specs, {"format": "pt"}) as out:
        ...     for spec in out.specs:
        ...         out.write(spec.name, tensors[spec.name])
    """

    def __init__(self, path: Path, specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None) -> None:
        if sys.byteorder != "little":  # pragma: no cover - torch's platforms are little-endian
            raise MergeError("Writing safetensors needs a little-endian machine; use --unsafe_serialization here.")
        self.path = path
        self.specs = file_order(specs)
        self.checksums: dict[str, int] = {}
        self._next = 0
        self._file: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._file.write(build_header(self.specs, metadata))

    def write(self, name: str, tensor: Any) -> None:
        spec = self.specs[self._next]
        if name != spec.name:
            raise ValueError(f"tensors must be written in file order: expected {spec.name!r}, got {name!r}")
        if str(tensor.dtype).removeprefix("torch.") != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(f"{name!r} is {tensor.dtype} {tuple(tensor.shape)}, the header says {spec.dtype} {spec.shape}")
        data = tensor_bytes(tensor)
        self._file.write(data)
        self.checksums[name] = checksum(data)
        self._next += 1

    def close(self) -> None:
        """Flush to disk (fsync): a verified file must be on disk before anything relies on it."""
        if self._file.closed:
            return
        try:
            if self._next != len(self.specs):
                raise ValueError(f"{len(self.specs) - self._next} tensors were not written to {self.path}")
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()

    def abort(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:  # noqa: ANN001
        if exc_type is None:
            self.close()
        else:
            self.abort()


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The parsed header and the offset where tensor data starts. Raises ValueError on a malformed file."""
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) != 8:
            raise ValueError("the file is shorter than the 8-byte header length")
        (length,) = struct.unpack("<Q", prefix)
        if length > os.fstat(file.fileno()).st_size - 8:
            raise ValueError(f"the header length {length} runs past the end of the file")
        header = json.loads(file.read(length).decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header, 8 + length


def read_checksums(path: Path, *, from_disk: bool = False) -> tuple[dict[str, Any], dict[str, int]]:
    """Read a safetensors file back: its header and the checksum of every tensor's bytes.

    The file is read sequentially in large blocks. With `from_disk`, the page cache is dropped first
    (where the OS allows; the file must have been fsynced), so the bytes come from the disk rather than
    from what was just written.
    """
    if from_disk:
        drop_cache(path)
    header, start = read_header(path)
    tensors = sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0])
    sums: dict[str, int] = {}
    with open(path, "rb") as file:
        position = 0
        file.seek(start)
        for name, info in tensors:
            begin, end = info["data_offsets"]
            if begin != position:
                raise ValueError(f"{name!r} starts at byte {begin}, expected {position}")
            value, remaining = 0, end - begin
            while remaining:
                block = file.read(min(remaining, _READ_CHUNK))
                if not block:
                    raise ValueError(f"the file ends inside {name!r}")
                value = checksum(block, value)
                remaining -= len(block)
            sums[name] = value
            position = end
        if file.read(1):
            raise ValueError("there are bytes after the last tensor")
    return header, sums


def drop_cache(path: Path) -> None:
    """Ask the OS to forget its cached pages of a (fsynced) file, so the next read comes from the disk."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)
