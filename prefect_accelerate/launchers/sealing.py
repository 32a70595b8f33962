"""Making a launch's files safe to leave on disk: secret values redacted, owner-only modes.

The supervisor seals its run folder when a launch ends; the watchdog, and the next launch, seal what a
supervisor killed with -9 left (watchdog.py).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from prefect_accelerate.launchers.state import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE
from prefect_accelerate.secrets import Redactor, known_secret_values


def seal_folder(folder: Path, redact: Redactor) -> None:
    """Replace known secret values in every file under `folder`, and make it and them owner-only.

    Written files are torchrun's per-rank logs (the workers' raw output) and our own; each is rewritten
    line by line through `redact` only when a secret is in it.
    """
    if not folder.is_dir():
        return
    for root, dirs, files in os.walk(folder):
        with contextlib.suppress(OSError):
            os.chmod(root, PRIVATE_DIR_MODE)
        for name in files:
            path = Path(root, name)
            with contextlib.suppress(OSError):
                if path.is_symlink() or not path.is_file():
                    continue
                os.chmod(path, PRIVATE_FILE_MODE)
                _redact_file(path, redact)


def _redact_file(path: Path, redact: Redactor) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.redact")
    changed = False
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
    try:
        with open(path, encoding="utf-8", errors="surrogateescape", newline="") as source, \
                open(fd, "w", encoding="utf-8", errors="surrogateescape", newline="") as target:
            for line in source:  # streamed: per-rank logs can be large
                cleaned = redact(line)
                changed = changed or cleaned != line
                target.write(cleaned)
        if changed:
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def seal_leftovers(run_dir: Path, log_dir: Path | None) -> None:
    """Redact the secret values this environment knows from a launch's folders and make them owner-only."""
    redact = Redactor(known_secret_values())
    for folder in (run_dir, log_dir):
        if folder is not None:
            seal_folder(folder, redact)
