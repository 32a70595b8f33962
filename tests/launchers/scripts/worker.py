"""Test worker for launch tests. Behaviour by environment variable:

WORKER_PID_DIR: write this process's pid to <dir>/<rank>.pid
WORKER_MODE: allreduce (default) | fail_rank1 | raise_rank1 | sleep | stubborn | print_token | env_dump
  stubborn: ignore SIGTERM and start a grandchild in a session of its own that ignores it too (its pid goes
  to <dir>/<rank>-child.pid), so only a SIGKILL of every tracked descendant ends them
  print_token: print the value of HF_TOKEN (the launcher must redact it)
WORKER_ENV_DIR: for env_dump, write os.environ as JSON to <dir>/<rank>.json
"""

import json
import os
import signal
import subprocess
import sys
import time


def main() -> None:
    """The modes that need no process group run before torch is imported (seconds on a loaded machine), so a test
    with a short deadline sees their pids and grandchildren however slow the imports are."""
    rank = int(os.environ.get("RANK", "0"))
    pid_dir = os.environ.get("WORKER_PID_DIR")
    if pid_dir:
        with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as handle:
            handle.write(str(os.getpid()))
    mode = os.environ.get("WORKER_MODE", "allreduce")
    if mode == "env_dump":
        with open(os.path.join(os.environ["WORKER_ENV_DIR"], f"{rank}.json"), "w") as handle:
            json.dump(dict(os.environ), handle)
        return
    if mode == "print_token":
        print(f"rank {rank} token {os.environ.get('HF_TOKEN')}", flush=True)
        return
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                  "time.sleep(600)"], start_new_session=True)
        with open(os.path.join(pid_dir, f"{rank}-child.pid"), "w") as handle:
            handle.write(str(child.pid))
        print(f"rank {rank} stubborn", flush=True)
        time.sleep(600)
        return
    if mode == "sleep":
        print(f"rank {rank} sleeping", flush=True)
        time.sleep(600)
        return
    from torch.distributed.elastic.multiprocessing.errors import record

    record(collective)(mode)


def collective(mode: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {value.item():.1f}", flush=True)
    if mode == "fail_rank1":
        # rank 1 fails first and alone: rank 0 leaves the group cleanly and waits, so the only failure
        # torchrun sees before stopping the others is rank 1's exit code 3
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank == 1:
            sys.exit(3)
        time.sleep(30)
        return
    if mode == "raise_rank1":
        # as above, but rank 1 raises: leaving the group first keeps gloo's teardown from aborting the
        # dying process (SIGABRT, exit -6) instead of the plain exit code 1 a Python error gives
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank == 1:
            raise RuntimeError("rank 1 deliberate failure")
        time.sleep(30)
        return
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
