"""The workload of the DeepSpeed `slurm` launcher test: examples/ds_train.py after a line naming the node and ranks.

srun starts this script directly (no torchrun, no DeepSpeed launcher), so the RANK, WORLD_SIZE and LOCAL_RANK
printed here come from the run folder's sitecustomize. DeepSpeed's shared-memory op is switched off as in
tests/launchers/scripts/ds_nojit.py (compiling it takes ~95 s on 2 cores).
FAIL_RANK / FAIL_RANK_CODE: that rank exits with that code before training; the others wait for it in
init_distributed until srun (--kill-on-bad-exit) ends them.
"""

import importlib
import os
import runpy
import sys
from pathlib import Path

TRAIN = str(Path(__file__).resolve().parents[4] / "examples" / "ds_train.py")

print(f"node={os.environ.get('SLURMD_NODENAME')} rank_env={os.environ.get('RANK')}/{os.environ.get('WORLD_SIZE')} "
      f"local={os.environ.get('LOCAL_RANK')} master={os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}", flush=True)
if os.environ.get("FAIL_RANK") == os.environ.get("RANK"):
    sys.exit(int(os.environ.get("FAIL_RANK_CODE", "1")))
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
sys.argv = [TRAIN, *sys.argv[1:]]
runpy.run_path(TRAIN, run_name="__main__")
