"""A tiny plain-torch job: every rank contributes rank+1 to an all_reduce (gloo on CPU, NCCL on GPUs).

Run it with `prefect-accelerate launch --cpu --num_processes 2 examples/ddp_allreduce.py`.
"""

import os

import torch
import torch.distributed as dist


def main() -> None:
    backend = "nccl" if torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true") else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    print(f"rank {rank}/{world}: all_reduce sum = {value.item():.1f} (expected {world * (world + 1) / 2:.1f})", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
