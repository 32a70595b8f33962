"""The output folder's side of a merge: staging, publishing with atomic renames, cleaning up after failures.

Files are written into `OUTPUT_DIR/.merge-weights-<host>-<pid>-<random>/` and renamed into place only
after they were read back; renames within one folder are atomic, so OUTPUT_DIR never holds a half-written
weights file. A merge killed outright (SIGKILL, power loss) leaves its staging folder behind; the next merge
into the same folder removes it once its process is gone.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path

from prefect_accelerate.errors import MergeError
from prefect_accelerate.merge.shards import OutputFormat, is_own_output

STAGING_PREFIX = ".merge-weights-"


def staging_prefix() -> str:
    return f"{STAGING_PREFIX}{_host()}-{os.getpid()}-"


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def remove_stale_staging(output: Path) -> None:
    """Remove staging folders a killed merge (SIGKILL, power loss) left here: same host, process gone."""
    pattern = re.compile(rf"^{re.escape(STAGING_PREFIX + _host())}-(\d+)-")
    for child in output.iterdir():
        match = pattern.match(child.name)
        if match and child.is_dir() and not _process_alive(int(match.group(1))):
            shutil.rmtree(child, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def publish(staging: Path, output: Path, names: list[str], fmt: OutputFormat) -> list[str]:
    """Move the checked files into place, index last, then remove older outputs of the same format.

    Each move is an atomic rename within one file system; the order means a reader never sees an index
    that points at files not there yet.
    """
    for name in names:
        os.replace(staging / name, output / name)
    stale = [p for p in output.iterdir() if p.is_file() and is_own_output(p.name, fmt) and p.name not in names]
    for path in sorted(stale, key=lambda p: not p.name.endswith(".index.json")):
        path.unlink()
    fsync_dir(output)
    return sorted(p.name for p in stale)


def write_text_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


def fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def make_dirs(output: Path) -> list[Path]:
    """Create the output folder and its missing parents; return what was created, outermost first."""
    missing = [p for p in [output, *output.parents] if not p.exists()]
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise MergeError(
            f"Could not create the output folder {output} ({error.strerror or error}). Check the path and permissions."
        ) from error
    return list(reversed(missing))


def remove_created(created: list[Path]) -> None:
    for folder in reversed(created):
        try:
            folder.rmdir()
        except OSError:
            return

