"""Byte counts for people: Accelerate's table format, binary units for our own figures, and parsing.

Accelerate's table divides by 1024 but labels the steps "KB, MB, GB"; we keep that in the table so it
reads exactly like `accelerate estimate-memory`, and use honest binary labels (KiB, MiB, GiB) for
everything else we print.
"""

from __future__ import annotations

import re

from prefect_accelerate.errors import UsageError

_ACCELERATE_UNITS = ("bytes", "KB", "MB", "GB", "TB")
_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_SIZE_FACTORS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def accelerate_size(size: int | float) -> str:
    """Format like Accelerate's `convert_bytes`: steps of 1024, two decimals, labels bytes/KB/MB/GB/TB/PB.

    The value's type matters as it does there: an int below 1024 prints without a decimal point.
    """
    for unit in _ACCELERATE_UNITS:
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def human_bytes(size: int | float) -> str:
    """Binary units with IEC labels, e.g. ``human_bytes(3 * 2**30) == '3.00 GiB'``."""
    value = float(size)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in _BINARY_UNITS:
        if value < 1024.0 or unit == _BINARY_UNITS[-1]:
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.2f} {unit}"
        value /= 1024.0
    raise AssertionError("unreachable")


def parse_memory_size(text: str | int | float) -> int:
    """Parse a device memory size: ``80GiB``, ``80GB`` (decimal, as disks and Accelerate count), ``81920MiB``, bytes.

    Raises:
        UsageError: the text is not a size.
    """
    if isinstance(text, bool):
        raise UsageError(f"Device memory must be a size such as `80GiB`, not {text!r}.")
    if isinstance(text, (int, float)):
        if text <= 0:
            raise UsageError(f"Device memory must be positive, got {text!r}.")
        return int(text)
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_FACTORS:
        raise UsageError(
            f"`{text}` is not a memory size. Write a number with a unit, for example `80GiB` (binary, "
            "2**30 bytes per GiB), `80GB` (decimal) or `81920MiB`; a bare number counts bytes."
        )
    value = int(float(match.group(1)) * _SIZE_FACTORS[unit])
    if value <= 0:
        raise UsageError(f"Device memory must be positive, got `{text}`.")
    return value
