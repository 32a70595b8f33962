"""The checks a merge makes before it writes anything: input, output folder, removal, format, disk space."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from prefect_accelerate.errors import MergeError
from prefect_accelerate.merge.checkpoint import Checkpoint, open_checkpoint
from prefect_accelerate.merge.layout import METADATA_FILE, SHARD_SUFFIX, sibling_model_folder
from prefect_accelerate.merge.safetensors_file import unsupported_dtypes
from prefect_accelerate.merge.shards import DEFAULT_MAX_SHARD_SIZE, format_size, parse_size

#: headers and the index on top of the tensor bytes
FREE_SPACE_SLACK = 1 << 20


def check_merge(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    unsafe_serialization: bool = False,
    remove_checkpoint_dir: bool = False,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> Checkpoint:
    """Every check `merge_weights` makes before it writes anything; reads only `.metadata`.

    The CLI runs it before starting a tracked flow, so a wrong folder is reported at once and plainly.

    Raises:
        MergeError, UsageError: as `merge_weights` would, before writing.
    """
    parse_size(max_shard_size)
    checkpoint = open_checkpoint(checkpoint_dir)
    check_output(Path(output_dir).expanduser(), checkpoint.folder, remove_checkpoint_dir)
    if remove_checkpoint_dir:
        check_removable(checkpoint.folder)
    if not unsafe_serialization:
        check_not_optimizer_state(checkpoint)
        check_safetensors_can_hold(checkpoint)
    return checkpoint


def check_not_optimizer_state(checkpoint: Checkpoint) -> None:
    """Optimizer state is not weights; a safetensors file cannot hold it (Accelerate fails there too)."""
    if not checkpoint.holds_optimizer_state:
        return
    model = sibling_model_folder(checkpoint.folder)
    where = (
        f"Pass the model folder saved beside it: {model}"
        if model is not None
        else "Pass the `pytorch_model_fsdp_<i>` folder Accelerate's `save_state` wrote beside it"
    )
    raise MergeError(
        f"{checkpoint.folder} holds optimizer state ({len(checkpoint.entries)} entries under `state` and `param_groups`), "
        f"not model weights. {where}. To consolidate the optimizer state itself, add --unsafe_serialization: it is "
        "written as one full optimizer state dict to pytorch_model.bin, as Accelerate does."
    )


def check_output(output: Path, checkpoint: Path, remove: bool) -> None:
    if output.exists() and not output.is_dir():
        raise MergeError(f"The output path {output} is a file; merge-weights writes into a folder. Pass a folder path (it is created if missing).")
    for parent in output.parents:
        if parent.exists():
            if not parent.is_dir():
                raise MergeError(f"The output folder {output} cannot be created: {parent} is a file. Pass another output path.")
            break
    if remove:
        resolved_out, resolved_ckpt = output.resolve(), checkpoint.resolve()
        if resolved_out == resolved_ckpt or resolved_ckpt in resolved_out.parents:
            raise MergeError(
                f"The output folder {output} is inside the checkpoint folder {checkpoint}, which --remove_checkpoint_dir "
                "would delete together with the merged weights. Pass an output folder outside it."
            )


def check_removable(folder: Path) -> None:
    if folder.is_symlink():
        raise MergeError(
            f"{folder} is a symbolic link; --remove_checkpoint_dir removes only real checkpoint folders. "
            "Pass the folder it points to, or remove the link and its target yourself."
        )
    others = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir()
                    if not (p.is_file() and (p.name == METADATA_FILE or p.name.endswith(SHARD_SUFFIX))))
    if others:
        listed = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise MergeError(
            f"Refusing --remove_checkpoint_dir: {folder} also holds {listed}, which are not part of the checkpoint "
            "and would be deleted with it. Move them out, or merge without --remove_checkpoint_dir."
        )


def check_safetensors_can_hold(checkpoint: Checkpoint) -> None:
    if checkpoint.objects:
        names = ", ".join(e.name for e in checkpoint.objects[:5]) + (" ..." if len(checkpoint.objects) > 5 else "")
        raise MergeError(
            f"{checkpoint.folder} holds {len(checkpoint.objects)} non-tensor entries ({names}), which a safetensors file "
            "cannot store. Pass --unsafe_serialization to write pytorch_model.bin (a pickle) with them, or save the "
            "model without them."
        )
    bad = unsupported_dtypes(e.dtype or "" for e in checkpoint.tensors)
    if bad:
        names = ", ".join(e.name for e in checkpoint.tensors if e.dtype in bad)[:200]
        raise MergeError(
            f"safetensors has no dtype for {', '.join(bad)} (tensors {names}). Pass --unsafe_serialization to write "
            "pytorch_model.bin instead."
        )


def check_free_space(output: Path, needed: int) -> None:
    try:
        free = shutil.disk_usage(output).free
    except OSError:
        return
    if free < needed + FREE_SPACE_SLACK:
        raise MergeError(
            f"The merged weights need about {format_size(needed)}, but the disk holding {output} has {format_size(free)} "
            "free. Free some space or pass an output folder on another disk."
        )

