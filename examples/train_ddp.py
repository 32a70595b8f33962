"""A short data-parallel training run in plain torch: a tiny regression model, synthetic data.

Each process trains on its own shard (DistributedSampler); DDP averages the gradients, so every rank
ends with the same weights. Runs on CPU (gloo) or GPUs (NCCL), under `prefect-accelerate launch` or
`torchrun`. This is what `./dev demo` launches after the preflight checks.

    prefect-accelerate launch --cpu --num_processes 2 examples/train_ddp.py --steps 30
"""

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    on_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true") or not torch.cuda.is_available()
    dist.init_process_group("gloo" if on_cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if on_cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))

    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(512, 8, generator=generator)
    targets = inputs @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1
    dataset = TensorDataset(inputs, targets)
    loader = DataLoader(dataset, batch_size=16, sampler=DistributedSampler(dataset, num_replicas=world, rank=rank, seed=0))

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    step = 0
    while step < args.steps:
        for batch, target in loader:
            loss = torch.nn.functional.mse_loss(model(batch.to(device)), target.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and (step % 10 == 0 or step == 1):
                print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
            if step >= args.steps:
                break
    checksum = sum(p.detach().sum().item() for p in model.parameters())
    print(f"rank {rank}/{world} finished {step} steps, weight checksum {checksum:.6f}", flush=True)
    # free the DDP module (it sits in reference cycles) while the group is alive: left to the interpreter's
    # shutdown, gloo's destructors can abort the process (SIGABRT) after a successful run
    del model, optimizer, loss
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
