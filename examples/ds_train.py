"""A tiny DeepSpeed training job that takes its settings from the launcher, as Accelerate's plugin does.

    prefect-accelerate launch --use_deepspeed --num_processes 2 --zero_stage 2 examples/ds_train.py --save_dir ckpt

The launcher exports ACCELERATE_DEEPSPEED_ZERO_STAGE, ACCELERATE_MIXED_PRECISION,
ACCELERATE_GRADIENT_ACCUMULATION_STEPS, ACCELERATE_GRADIENT_CLIPPING and ACCELERATE_DEEPSPEED_CONFIG_FILE;
this script builds its DeepSpeed config from them and calls `deepspeed.initialize` itself, so it also runs
on a CPU-only machine (DeepSpeed's CPU accelerator with gloo), where Accelerate's own DeepSpeed
integration does not start. Each rank trains on its own batches, then every rank prints the loss of the
same evaluation batch: equal values mean the ranks hold the same weights. A client optimizer
(torch.optim.AdamW) keeps DeepSpeed from compiling its fused Adam.
"""

from __future__ import annotations

import argparse
import gc
import json
import os


def deepspeed_config(micro_batch: int) -> dict:
    """DeepSpeed's config from the launcher's variables (the JSON file wins where it says something)."""
    config: dict = {}
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    for key in ("train_micro_batch_size_per_gpu", "train_batch_size"):
        if config.get(key) == "auto":
            del config[key]
    config.setdefault("train_micro_batch_size_per_gpu", micro_batch)
    if config.get("gradient_accumulation_steps", "auto") == "auto":
        config["gradient_accumulation_steps"] = int(os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1"))
    clipping = os.environ.get("ACCELERATE_GRADIENT_CLIPPING")
    if clipping and config.get("gradient_clipping", "auto") == "auto":
        config["gradient_clipping"] = float(clipping)
    zero = config.setdefault("zero_optimization", {})
    if zero.get("stage", "auto") == "auto":
        zero["stage"] = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if precision in ("bf16", "fp16"):
        config.setdefault(precision, {})["enabled"] = True
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro_batch", type=int, default=4)
    parser.add_argument("--save_dir", default=None, help="write a DeepSpeed checkpoint here after training")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by DeepSpeed's launcher; unused")
    args = parser.parse_args()

    import deepspeed
    import torch

    deepspeed.init_distributed()
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = deepspeed_config(args.micro_batch)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else torch.float32

    def loss_of(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        outputs = engine(inputs.to(engine.device, dtype))
        return torch.nn.functional.mse_loss(outputs.float(), targets.to(engine.device))

    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
    for step in range(args.steps):
        inputs, targets = torch.randn(args.micro_batch, 16, generator=data), torch.randn(args.micro_batch, 1, generator=data)
        loss = loss_of(inputs, targets)
        engine.backward(loss)
        engine.step()
        print(f"rank {rank} step {step} train_loss {loss.item():.6f}", flush=True)

    common = torch.Generator().manual_seed(7)
    with torch.no_grad():
        eval_loss = loss_of(torch.randn(8, 16, generator=common), torch.randn(8, 1, generator=common))
    world = torch.distributed.get_world_size()
    print(f"rank {rank} of {world} zero_stage {engine.zero_optimization_stage()} dtype {str(dtype).split('.')[-1]} "
          f"eval_loss {eval_loss.item()!r}", flush=True)
    if args.save_dir:
        engine.save_checkpoint(args.save_dir, tag=f"step{args.steps}")
        print(f"rank {rank} saved {args.save_dir}", flush=True)
    torch.distributed.barrier()
    # leave cleanly: a process whose engine (or DDP module) is still alive when the interpreter shuts down can
    # abort in gloo's C++ destructors ("terminate called without an active exception", SIGABRT). So drop every
    # reference, collect the cycles while the group still exists, then destroy the group.
    engine.destroy()
    del engine, loss_of, model, optimizer, loss
    gc.collect()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
