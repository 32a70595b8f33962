"""Run a DeepSpeed script without compiling DeepSpeed's shared-memory all-reduce op.

    python ds_nojit.py SCRIPT [args...]

On the CPU accelerator every `deepspeed.init_distributed` builds `deepspeed_shm_comm` (~95 s on 2 cores the
first time) and leaves ~66 MB per rank in /dev/shm; gloo does the same work without it. The op has to be
switched off through importlib: `import deepspeed.comm.torch` names torch itself, because deepspeed.comm
re-exports torch under that name. DeepSpeed's launcher puts --local_rank=N before the script's own
arguments; it is moved behind them here.
"""

import importlib
import runpy
import sys

importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

arguments = sys.argv[1:]
local_rank = [arg for arg in arguments if arg.startswith("--local_rank")]
rest = [arg for arg in arguments if not arg.startswith("--local_rank")]
sys.argv = [rest[0], *rest[1:], *local_rank]
runpy.run_path(rest[0], run_name="__main__")
