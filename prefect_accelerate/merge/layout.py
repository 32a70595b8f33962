"""Find the distributed checkpoint folder the user meant, or say what is there instead.

Accelerate's `save_state` under SHARDED_STATE_DICT writes `<dir>/pytorch_model_fsdp_<i>/` (the model) and
`<dir>/optimizer_<i>/` beside it. Each is a torch Distributed Checkpoint (DCP) folder: one
`__<rank>_<n>.distcp` file per writer, and `.metadata`, which rank 0 writes last. Users often pass the
parent folder or the optimizer folder (accelerate#2848, whose improved message is checked inside the
missing folder and so never shows); the errors here name the folder to pass instead.

No torch import: this only looks at names on disk.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from prefect_accelerate.errors import MergeError, did_you_mean

METADATA_FILE = ".metadata"
SHARD_SUFFIX = ".distcp"
MODEL_FOLDER_RE = re.compile(r"^pytorch_model_fsdp_(\d+)$")
OPTIMIZER_FOLDER_RE = re.compile(r"^optimizer_(\d+)$")
#: files that mean "already merged": ours and transformers', and Accelerate's FULL_STATE_DICT save
_MERGED_FILE_RE = re.compile(
    r"^(model(-\d{5}-of-\d{5})?\.safetensors|pytorch_model(-\d{5}-of-\d{5})?\.bin|"
    r"(model\.safetensors|pytorch_model\.bin)\.index\.json|pytorch_model_fsdp(_\d+)?\.bin)$"
)
#: how far below a wrong folder we look for checkpoint folders, and how many folders at most
SCAN_DEPTH = 3
SCAN_LIMIT = 2000
_SHOWN = 6


def is_dcp_folder(path: Path) -> bool:
    return (path / METADATA_FILE).is_file()


def locate_checkpoint(path: str | os.PathLike[str]) -> Path:
    """Return CHECKPOINT_DIR as a DCP folder, or raise MergeError saying what is there and what to pass.

    Raises:
        MergeError: the path is missing, a file, or a folder without `.metadata` (the message lists the
            checkpoint folders found below it, the model one first).
    """
    folder = Path(path).expanduser()
    if not folder.exists():
        raise MergeError(_missing_message(folder))
    if not folder.is_dir():
        raise MergeError(_file_message(folder))
    if is_dcp_folder(folder):
        return folder
    raise MergeError(_not_a_checkpoint_message(folder))


def sibling_model_folder(optimizer_folder: Path) -> Path | None:
    """The model folder Accelerate saved beside `optimizer_<i>` (same index first), if there is one."""
    match = OPTIMIZER_FOLDER_RE.match(optimizer_folder.name)
    parent = optimizer_folder.parent
    if match and is_dcp_folder(parent / f"pytorch_model_fsdp_{match.group(1)}"):
        return parent / f"pytorch_model_fsdp_{match.group(1)}"
    models = [p for p in _children(parent) if MODEL_FOLDER_RE.match(p.name) and is_dcp_folder(p)]
    return models[0] if len(models) == 1 else None


def find_dcp_folders(root: Path, depth: int = SCAN_DEPTH, limit: int = SCAN_LIMIT) -> list[Path]:
    """DCP folders at most `depth` levels below `root`, model folders first, then by path."""
    found: list[Path] = []
    level = [root]
    visited = 0
    for _ in range(depth):
        next_level: list[Path] = []
        for folder in level:
            for child in _children(folder):
                visited += 1
                if visited > limit:
                    return _model_first(found)
                if is_dcp_folder(child):
                    found.append(child)
                else:
                    next_level.append(child)
        level = next_level
    return _model_first(found)


def _children(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []


def _model_first(folders: list[Path]) -> list[Path]:
    def rank(p: Path) -> tuple[int, str]:
        if MODEL_FOLDER_RE.match(p.name):
            return (0, str(p))
        if OPTIMIZER_FOLDER_RE.match(p.name):
            return (2, str(p))
        return (1, str(p))

    return sorted(folders, key=rank)


def _suggest(folders: list[Path]) -> str:
    models = [p for p in folders if not OPTIMIZER_FOLDER_RE.match(p.name)]
    shown = ", ".join(str(p) for p in folders[:_SHOWN]) + (f" (and {len(folders) - _SHOWN} more)" if len(folders) > _SHOWN else "")
    if len(models) == 1:
        return f"It contains the checkpoint folders {shown}. Pass the model weights folder instead: {models[0]}"
    if models:
        return f"It contains several checkpoint folders: {shown}. Pass the model weights folder of the checkpoint you want (a `pytorch_model_fsdp_<i>` folder)."
    return (
        f"It contains only optimizer checkpoint folders ({shown}), which hold optimizer state, not model weights; "
        "pass the `pytorch_model_fsdp_<i>` folder Accelerate saved beside them."
    )


def _missing_message(folder: Path) -> str:
    text = f"The checkpoint folder {folder} does not exist."
    parent = folder.parent
    if parent.is_dir():
        near = find_dcp_folders(parent, depth=2)
        if near:
            hint = did_you_mean(folder.name, [p.name for p in near])
            listed = ", ".join(str(p) for p in near[:_SHOWN])
            text += f"{hint} Checkpoint folders near it: {listed}."
        else:
            text += f" {parent} exists but holds no distributed checkpoint folder (one with a `{METADATA_FILE}` file)."
    return text + " Pass the folder Accelerate's `save_state` wrote the model to, e.g. `<output_dir>/pytorch_model_fsdp_0`."


def _file_message(path: Path) -> str:
    if path.name == METADATA_FILE or path.name.endswith(SHARD_SUFFIX):
        return f"{path} is a file of a distributed checkpoint; pass the folder that holds it instead: {path.parent}"
    if _MERGED_FILE_RE.match(path.name):
        return (
            f"{path} is already a merged weights file, so there is nothing to merge: load it directly "
            "(merge-weights takes a sharded checkpoint folder with `.metadata` and `*.distcp` files)."
        )
    return f"{path} is a file; merge-weights takes a distributed checkpoint folder (one with `.metadata` and `*.distcp` files)."


def _not_a_checkpoint_message(folder: Path) -> str:
    head = f"{folder} is not a distributed checkpoint folder: it has no `{METADATA_FILE}` file."
    try:
        entries = sorted(folder.iterdir(), key=lambda p: p.name)
    except OSError as error:
        return f"{head} Its content could not be listed ({error.strerror or error})."
    shards = [p.name for p in entries if p.name.endswith(SHARD_SUFFIX)]
    if shards:
        return (
            f"{head} It has {len(shards)} `*{SHARD_SUFFIX}` shard file(s), but `{METADATA_FILE}` is written last, after "
            "every rank finished saving: the save was interrupted, or the folder was copied without its hidden "
            f"`{METADATA_FILE}` file (`cp -r folder/*` skips it). Copy it too, or save the checkpoint again."
        )
    folders = find_dcp_folders(folder)
    if folders:
        return f"{head} {_suggest(folders)}"
    merged = [p.name for p in entries if _MERGED_FILE_RE.match(p.name)]
    if merged:
        return (
            f"{head} It holds already merged weights ({', '.join(merged[:_SHOWN])}), so there is nothing to merge: "
            "load them directly. A checkpoint saved with FULL_STATE_DICT needs no merge."
        )
    if not entries:
        return f"{head} The folder is empty. Pass the `pytorch_model_fsdp_<i>` folder Accelerate's `save_state` wrote."
    names = [p.name + ("/" if p.is_dir() else "") for p in entries]
    listed = ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
    return (
        f"{head} It contains {listed}, and no checkpoint folder within {SCAN_DEPTH} levels below. Pass the "
        "`pytorch_model_fsdp_<i>` folder Accelerate's `save_state` wrote (saved with SHARDED_STATE_DICT)."
    )
