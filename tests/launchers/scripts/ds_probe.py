"""A light rank for DeepSpeed launcher tests: gloo all-reduce, no DeepSpeed import (that costs seconds per rank).

Prints `rank R of W sum S stage Z` where Z is ACCELERATE_DEEPSPEED_ZERO_STAGE as this rank received it.
PROBE_PID_DIR: write this process's pid to <dir>/<rank>.pid. PROBE_SLEEP: sleep this long after the
all-reduce (for stop tests). Arguments (DeepSpeed's --local_rank=N among them) are ignored.
"""

import os
import time

import torch
import torch.distributed as dist

rank = int(os.environ.get("RANK", "0"))
if os.environ.get("PROBE_PID_DIR"):
    with open(os.path.join(os.environ["PROBE_PID_DIR"], f"{rank}.pid"), "w") as handle:
        handle.write(str(os.getpid()))
dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "unset")
print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {value.item():.1f} stage {stage}", flush=True)
time.sleep(float(os.environ.get("PROBE_SLEEP", "0")))
dist.barrier()
dist.destroy_process_group()
