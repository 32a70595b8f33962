"""The training script the Slurm tests launch: DDP on gloo, one step; optional failure, hang and child processes.

FAIL_RANK / FAIL_RANK_CODE: that rank raises (under torchrun's @record) so its error and code are reported;
the other ranks are still at work when it does (a few seconds more), as a peer is when one rank breaks, so the
failing node is the first to end and the others are stopped by srun after it.
HANG_DIR: after the step every rank writes its pid and a double-forked `sleep`'s pid there, then hangs.

Each rank leaves with os._exit once its work is done. Under load, torch 2.13's gloo sometimes aborts the
interpreter while it shuts down ("terminate called without an active exception", SIGABRT). Bare torchrun,
two nodes on loopback, three busy loops: 3 of 20 runs aborted with a normal exit and 0 of 20 with os._exit.
These tests are about our launcher, not that torch bug.
"""

import os
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp(torch.randn(8, 4) + rank).sum().backward()
    torch.optim.SGD(ddp.parameters(), lr=0.1).step()
    weights = sum(p.detach().sum().item() for p in model.parameters())
    print(f"rank={rank} world={world} weights={weights:.6f} node={os.environ.get('SLURMD_NODENAME')}", flush=True)
    if str(rank) == os.environ.get("FAIL_RANK"):
        code = int(os.environ.get("FAIL_RANK_CODE", "1"))
        raise SystemExit(code) if code != 1 else RuntimeError(f"rank {rank} broke on purpose")
    if os.environ.get("FAIL_RANK"):
        time.sleep(20)  # still working; srun ends this node once the failing one has
    hang = os.environ.get("HANG_DIR")
    if hang:
        escaped = subprocess.Popen(["setsid", "sleep", "1000"], start_new_session=True).pid
        with open(os.path.join(hang, f"pids-{rank}"), "w") as out:
            out.write(f"{os.getpid()} {escaped}\n")
        time.sleep(1000)
    dist.destroy_process_group()


def _leave(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as stop:
        _leave(stop.code if isinstance(stop.code, int) else 1)
    except BaseException:  # noqa: BLE001 - printed as Python would, then the code Python would give
        traceback.print_exc()
        _leave(1)
    _leave(0)
