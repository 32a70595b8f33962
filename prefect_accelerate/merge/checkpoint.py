"""Read a torch Distributed Checkpoint without a process group: its table of contents, then tensors on demand.

`.metadata` lists every entry with its global shape, dtype and the chunks each rank wrote. We check it
against the files before reading anything (missing or truncated `.distcp` files, chunks that do not cover
a tensor), then load tensors in groups through DCP's own reader into plain CPU tensors of the full
shape, so memory holds one group at a time rather than the whole model.

Entries are named as Accelerate names them after its merge: when the saved state dict had one top-level
key (`{"model": model.state_dict()}`), that level is dropped.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect_accelerate.errors import MergeError
from prefect_accelerate.merge.layout import METADATA_FILE, OPTIMIZER_FOLDER_RE, locate_checkpoint

_OPTIMIZER_KEYS = {"state", "param_groups"}
_SHOWN = 5


@dataclass(frozen=True)
class CheckpointEntry:
    """One value in the checkpoint: a tensor (dtype set) or a pickled object (dtype None)."""

    key: str  # the key in `.metadata`, e.g. "model.embed.weight"
    name: str  # the name in the merged file, e.g. "embed.weight"
    dtype: str | None  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...] = ()
    nbytes: int = 0
    #: where it sits in the saved state dict below the unwrapped level: ("embed.weight",) for a model,
    #: ("state", "head.bias", "exp_avg") or ("param_groups", 0, "lr") for optimizer state
    path: tuple[str | int, ...] = ()

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None


@dataclass(frozen=True)
class Checkpoint:
    """A checked DCP folder: its entries in checkpoint order, and the level that was unwrapped."""

    folder: Path
    entries: tuple[CheckpointEntry, ...]
    unwrapped_key: str | None
    shard_files: tuple[str, ...]
    metadata: Any = field(repr=False, compare=False)
    #: the entries are an optimizer's `state` and `param_groups` (Accelerate's `optimizer_<i>` folder)
    holds_optimizer_state: bool = False

    @property
    def nested(self) -> bool:
        """True when the state dict has levels below the unwrapped one (optimizer state, custom dicts)."""
        return any(len(e.path) > 1 for e in self.entries)

    @property
    def tensors(self) -> list[CheckpointEntry]:
        return [e for e in self.entries if e.is_tensor]

    @property
    def objects(self) -> list[CheckpointEntry]:
        return [e for e in self.entries if not e.is_tensor]

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Locate and check a DCP folder and list its entries; reads `.metadata` only.

    `.metadata` is a pickle (as in every DCP checkpoint): open only checkpoints you trust.

    Raises:
        MergeError: wrong folder, unreadable `.metadata`, missing or truncated shard files.
    """
    folder = locate_checkpoint(path)
    metadata = read_metadata(folder)
    entries_md = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries_md, dict):
        raise MergeError(
            f"{folder / METADATA_FILE} is not a torch Distributed Checkpoint table of contents (it unpickles to "
            f"{type(metadata).__name__}). Pass a folder saved with torch.distributed.checkpoint."
        )
    if not entries_md:
        raise MergeError(f"{folder / METADATA_FILE} lists no entries: the checkpoint is empty. Save the model again.")
    paths = _entry_paths(metadata)
    unwrapped = _single_top_level_key(paths)
    level = 1 if unwrapped is not None else 0
    entries = tuple(_entry(key, md, paths[key][level:]) for key, md in entries_md.items())
    _refuse_name_clashes(folder, entries)
    shard_files = _check_storage(folder, metadata)
    return Checkpoint(folder=folder, entries=entries, unwrapped_key=unwrapped, shard_files=shard_files, metadata=metadata,
                      holds_optimizer_state=_looks_like_optimizer_state(folder, entries))


def read_metadata(folder: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(folder)).read_metadata()
    except Exception as error:  # a damaged pickle raises anything from EOFError to AttributeError
        import torch

        raise MergeError(
            f"Could not read {folder / METADATA_FILE} ({type(error).__name__}: {_short(error)}). The file is damaged "
            f"or truncated, or was written by a torch version this one (torch {torch.__version__}) cannot read. "
            "Copy it again from where the checkpoint was saved, or merge with the torch version that saved it."
        ) from error


def load_entries(checkpoint: Checkpoint, entries: Sequence[CheckpointEntry]) -> dict[str, Any]:
    """Read these entries into full-size CPU tensors (objects unpickled), keyed by `entry.key`.

    Raises:
        MergeError: the shard files do not hold what `.metadata` promises.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    state: dict[str, Any] = {
        e.key: torch.empty(e.shape, dtype=getattr(torch, e.dtype)) if e.is_tensor else None for e in entries
    }
    if not state:
        return state
    try:
        with warnings.catch_warnings():
            # "torch.distributed is disabled ... assuming the intent is to load in a single process": it is.
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load(
                state,
                storage_reader=_reader(checkpoint),
                # the keys already are the checkpoint's flat keys; flattening again would rename nothing but cost time
                planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                no_dist=True,
            )
    except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
        cause = _root_cause(error)
        names = ", ".join(e.key for e in list(entries)[:3]) + (", ..." if len(entries) > 3 else "")
        raise MergeError(
            f"Reading {names} from {checkpoint.folder} failed ({type(cause).__name__}: {_short(cause)}). The `*.distcp` "
            f"files do not hold what `{METADATA_FILE}` describes: they are damaged, or come from a different save "
            "than `.metadata`. Copy the whole folder again, or save the checkpoint again."
        ) from error
    return state


def _reader(checkpoint: Checkpoint) -> Any:
    """DCP's file reader, handed the metadata we already read (it is a pickle; no need to read it per group)."""
    from torch.distributed.checkpoint import FileSystemReader

    class KnownMetadataReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return checkpoint.metadata

    return KnownMetadataReader(str(checkpoint.folder))


def _entry_paths(metadata: Any) -> dict[str, tuple[str | int, ...]]:
    """The nested-dict path of each key: ("model", "embed.weight") for "model.embed.weight" (ints index lists)."""
    planner_data = getattr(metadata, "planner_data", None) or {}
    paths: dict[str, tuple[str | int, ...]] = {}
    for key in metadata.state_dict_metadata:
        path = planner_data.get(key)
        ok = isinstance(path, (tuple, list)) and path and all(isinstance(p, (str, int)) for p in path)
        paths[key] = tuple(path) if ok else (key,)
    return paths


def _single_top_level_key(paths: dict[str, tuple[str | int, ...]]) -> str | None:
    """Accelerate unwraps `{"model": {...}}`; a lone top-level tensor is not a level to unwrap."""
    tops = {path[0] for path in paths.values()}
    if len(tops) != 1 or any(len(path) < 2 for path in paths.values()):
        return None
    return str(next(iter(tops)))


def _looks_like_optimizer_state(folder: Path, entries: tuple[CheckpointEntry, ...]) -> bool:
    firsts = {e.path[0] for e in entries if e.path}
    if not firsts or not firsts <= _OPTIMIZER_KEYS:
        return False
    return "state" in firsts or bool(OPTIMIZER_FOLDER_RE.match(folder.name))


def _entry(key: str, md: Any, path: tuple[str | int, ...]) -> CheckpointEntry:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    name = ".".join(str(p) for p in path) or key
    if isinstance(md, TensorStorageMetadata):
        shape = tuple(int(s) for s in md.size)
        dtype = md.properties.dtype
        itemsize = dtype.itemsize if hasattr(dtype, "itemsize") else _itemsize(dtype)
        return CheckpointEntry(key, name, str(dtype).removeprefix("torch."), shape, math.prod(shape) * itemsize, path)
    return CheckpointEntry(key, name, None, path=path)


def _itemsize(dtype: Any) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _refuse_name_clashes(folder: Path, entries: tuple[CheckpointEntry, ...]) -> None:
    seen: dict[str, str] = {}
    for e in entries:
        if e.name in seen:
            raise MergeError(
                f"{folder / METADATA_FILE} has two entries that merge to the same name {e.name!r} ({seen[e.name]!r} and "
                f"{e.key!r}); a weights file cannot hold both. Rename one of them in the model and save again."
            )
        seen[e.name] = e.key


def _check_storage(folder: Path, metadata: Any) -> tuple[str, ...]:
    """Every chunk `.metadata` lists must be stored, and every file it points into must be long enough."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict) or not storage:
        raise MergeError(
            f"{folder / METADATA_FILE} says nothing about where the data is stored (no storage table). It was not "
            "written by torch.distributed.checkpoint's FileSystemWriter; save the checkpoint with it."
        )
    needed: dict[str, int] = {}
    stored: set[tuple[str, tuple[int, ...] | None]] = set()
    for index, info in storage.items():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str):
            continue
        needed[relative] = max(needed.get(relative, 0), int(info.offset) + int(info.length))
        offset = getattr(index, "offset", None)
        stored.add((index.fqn, tuple(int(o) for o in offset) if offset is not None else None))
    problems = []
    for relative, end in sorted(needed.items()):
        file = folder / relative
        if not file.is_file():
            problems.append(f"{relative} is missing")
        elif file.stat().st_size < end:
            problems.append(f"{relative} has {file.stat().st_size} bytes where {end} are needed (truncated)")
    if problems:
        shown = "; ".join(problems[:_SHOWN]) + (f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else "")
        raise MergeError(
            f"The checkpoint in {folder} is incomplete: {shown}. Copy the whole folder again (every `*.distcp` file "
            "and `.metadata`), or save the checkpoint again."
        )
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        covered = 0
        for chunk in md.chunks:
            if (key, tuple(int(o) for o in chunk.offsets)) not in stored:
                raise MergeError(
                    f"{folder / METADATA_FILE} lists a chunk of {key!r} at offset {list(chunk.offsets)} that no shard file "
                    "holds: `.metadata` and the `*.distcp` files come from different saves. Save the checkpoint again."
                )
            covered += math.prod(chunk.sizes)
        if covered < math.prod(md.size):
            raise MergeError(
                f"{folder / METADATA_FILE} describes {key!r} (shape {list(md.size)}) with chunks covering only {covered} of "
                f"{math.prod(md.size)} elements, so it cannot be rebuilt. Save the checkpoint again."
            )
    return tuple(sorted(needed))


def _root_cause(error: BaseException) -> BaseException:
    """The reading error itself, not DCP's per-rank wrapper with its formatted tracebacks."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        wrapped = next(iter(failures.values()))
        if isinstance(wrapped, tuple) and wrapped and isinstance(wrapped[0], BaseException):
            return wrapped[0]
    return error


def _short(error: BaseException, limit: int = 200) -> str:
    """The error's first sentence: torch's longer texts give advice (e.g. `weights_only=False`) that is wrong here."""
    text = " ".join(str(error).split()) or type(error).__name__
    text = re.split(r"(?<=[a-z0-9)])\. ", text, maxsplit=1)[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."
