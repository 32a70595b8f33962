"""Checkpoints for the merge tests.

`fsdp_checkpoint` is the real thing, made once per session: a two-process FSDP2 job on CPU (gloo),
started through our own launcher, saves a sharded checkpoint in Accelerate's `save_state` layout
(scripts/make_checkpoint.py). `make_checkpoint` saves a small state dict with torch.distributed.checkpoint
in this process (no process group), for the many tests that need a checkpoint but not a sharded one.
"""

from __future__ import annotations

import shutil
import socket
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parent / "scripts"
MODEL_FOLDER = "pytorch_model_fsdp_0"


def save_dcp(folder: Path, state: dict) -> Path:
    """Save `state` as a DCP checkpoint in `folder` from this one process."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    return folder


def _sample_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(11, 8, generator=g),
        "layers.0.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "layers.0.bias": torch.randn(8, generator=g).to(torch.float16),
        "layers.10.weight": torch.randn(8, 8, generator=g, dtype=torch.float64),
        "position_ids": torch.arange(7),
        "mask": torch.tensor([True, False, True]),
        "steps": torch.tensor(3, dtype=torch.int32),
        "empty": torch.zeros(0, 4),
        "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
    }


@pytest.fixture
def sample_state() -> dict[str, torch.Tensor]:
    """A little of everything a merge must carry over unchanged: dtypes, 0-dim, empty, NaN, -0.0, "10" after "0"."""
    return _sample_state()


@pytest.fixture
def make_checkpoint(tmp_path) -> Callable[..., Path]:
    """make_checkpoint(state=None, wrap="model", where="run") -> the `pytorch_model_fsdp_0` folder under tmp_path/where."""

    def make(state: dict | None = None, wrap: str | None = "model", where: str = "run") -> Path:
        state = _sample_state() if state is None else state
        folder = tmp_path / where / MODEL_FOLDER
        save_dcp(folder, {wrap: state} if wrap else state)
        return folder

    return make


@pytest.fixture(scope="session")
def fsdp_run(tmp_path_factory) -> Path:
    """The folder a real two-process FSDP2 save wrote: pytorch_model_fsdp_0/, optimizer_0/, full_state.pt, info.json.

    The same weights saved through FSDP1 (ShardedTensor) are in the sibling folder `fsdp1/pytorch_model_fsdp_0`.
    """
    from prefect_accelerate.launchers import plan_launch
    from prefect_accelerate.launchers.options import build_launch_options
    from prefect_accelerate.launchers.process import run_plan

    root = tmp_path_factory.mktemp("fsdp")
    out = root / "checkpoint"
    options = build_launch_options(
        str(SCRIPTS / "make_checkpoint.py"), [str(out), "--fsdp1", str(root / "fsdp1")], cpu=True, num_processes=2,
        mixed_precision="no", num_machines=1, dynamo_backend="no", main_process_port=_free_port(), run_dir=str(root / "launch"),
    )
    run_plan(plan_launch(options), timeout=240).raise_for_failure()
    return out


def _free_port() -> int:
    """Not 29500: other real-process tests may be running a rendezvous there at the same time."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def fsdp_checkpoint(fsdp_run, tmp_path) -> Path:
    """A private copy of the real checkpoint run folder (tests may delete or damage it)."""
    copy = tmp_path / "checkpoint"
    shutil.copytree(fsdp_run, copy)
    return copy
