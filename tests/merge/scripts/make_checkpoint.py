"""A two-process FSDP2 job on CPU (gloo) that saves a sharded checkpoint the way Accelerate's `save_state` does.

Launched through prefect-accelerate's own launcher (`launch --cpu --num_processes 2`), it shards a small
model with FSDP2 `fully_shard`, takes one Adam step so the weights and optimizer state are not the
initial ones, and writes, under OUTPUT:

    pytorch_model_fsdp_0/   torch.distributed.checkpoint of {"model": sharded state dict} (.metadata + *.distcp)
    optimizer_0/            the same for {"optimizer": sharded optimizer state}
    full_state.pt           the full (unsharded) model state dict, gathered, for comparison
    info.json               how the model was sharded, which keys are DTensors / ShardedTensors

and, with `--fsdp1 DIR`, DIR/pytorch_model_fsdp_0/: the same weights saved through FSDP1
(FullyShardedDataParallel, ShardedTensor), as Accelerate's default fsdp_version 1 saves them.

The model mixes what a merge has to get right: rows that do not split evenly over two ranks (a 5-row
head, an 11-row embedding), an int64 and a bfloat16 buffer that FSDP leaves replicated (saved once by
DCP's de-duplication), a non-persistent buffer that must not appear, and a 0-dim buffer.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

MODEL_FOLDER = "pytorch_model_fsdp_0"  # Accelerate: f"{FSDP_MODEL_NAME}_{index}"
OPTIMIZER_FOLDER = "optimizer_0"  # Accelerate: f"{OPTIMIZER_NAME}_{index}"


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyModel(nn.Module):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, 5)
        self.temperature = nn.Parameter(torch.tensor([0.5]))  # fully_shard refuses 0-dim parameters
        self.register_buffer("position_ids", torch.arange(7))
        self.register_buffer("scale", torch.linspace(0, 1, 3, dtype=torch.bfloat16))
        self.register_buffer("steps", torch.tensor(3))  # 0-dim
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x) * self.temperature


def save_fsdp1(full: dict, args: argparse.Namespace) -> list[str]:
    """The same weights through FSDP1 (FullyShardedDataParallel, ShardedTensor), saved the way Accelerate does."""
    import warnings

    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardedStateDictConfig, StateDictType

    model = TinyModel(args.hidden, args.layers)
    model.load_state_dict(full)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP1 and ShardedTensor deprecation notes
        # no device_mesh: with one, FSDP1 would hand out DTensors instead of ShardedTensors
        wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
        with FullyShardedDataParallel.state_dict_type(wrapped, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=True)):
            state = wrapped.state_dict()
        dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(str(args.fsdp1 / MODEL_FOLDER)))
    return sorted(k for k, v in state.items() if isinstance(v, ShardedTensor))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("output", type=Path)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--no-optimizer", dest="optimizer", action="store_false")
    parser.add_argument("--no-full-state", dest="full_state", action="store_false")
    parser.add_argument("--fsdp1", type=Path, default=None, help="also save the weights through FSDP1 here")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyModel(args.hidden, args.layers)

    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + rank)
    tokens = torch.randint(0, 11, (4, 6))
    model(tokens).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()

    sharded = get_model_state_dict(model)
    dcp.save({"model": sharded}, storage_writer=dcp.FileSystemWriter(str(args.output / MODEL_FOLDER)))
    if args.optimizer:
        optim_state = get_optimizer_state_dict(model, optimizer)
        dcp.save({"optimizer": optim_state}, storage_writer=dcp.FileSystemWriter(str(args.output / OPTIMIZER_FOLDER)))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if args.full_state and rank == 0:
        torch.save(full, args.output / "full_state.pt")
    fsdp1_keys: list[str] = []
    if args.fsdp1:  # every rank needs the full weights to build the FSDP1 copy (`full` is on rank 0 only)
        fsdp1_keys = save_fsdp1({k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sharded.items()}, args)
    if rank == 0:
        info = {
            "world_size": world,
            "sharding": "fully_shard",
            "dtensor_keys": sorted(k for k, v in sharded.items() if isinstance(v, DTensor)),
            "plain_keys": sorted(k for k, v in sharded.items() if not isinstance(v, DTensor)),
            "fsdp1_sharded_tensor_keys": fsdp1_keys,
            "pid": os.getpid(),
        }
        (args.output / "info.json").write_text(json.dumps(info, indent=1))
        print(f"saved a {world}-way sharded checkpoint to {args.output}", flush=True)
    del model, optimizer, sharded, full
    gc.collect()  # free the sharded module while the group is alive (gloo can abort at interpreter shutdown otherwise)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
