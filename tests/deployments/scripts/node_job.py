"""Test job for the multi-node deployment tests; every process writes its pid to NODE_JOB_PID_DIR/<rank>.pid.

NODE_JOB_MODE:
  fail_node1  the processes of machine 1 exit with code 3 at once; those of machine 0 wait for them in
              init_process_group (as real ranks wait for a peer that never comes) until they are stopped
  sleep       every process sleeps (a long training run) until it is stopped
"""

import datetime
import os
import sys
import time

import torch.distributed as dist

rank = int(os.environ["RANK"])
machine = int(os.environ["GROUP_RANK"])
with open(os.path.join(os.environ["NODE_JOB_PID_DIR"], f"{rank}.pid"), "w") as handle:
    handle.write(str(os.getpid()))
mode = os.environ.get("NODE_JOB_MODE", "sleep")
print(f"rank {rank} on machine {machine}: {mode}", flush=True)
if mode == "fail_node1" and machine == 1:
    sys.exit(3)
if mode == "fail_node1":
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
time.sleep(600)
