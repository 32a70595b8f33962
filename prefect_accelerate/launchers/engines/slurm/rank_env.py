"""torch.distributed's rank variables from Slurm's, for processes that `srun` starts directly.

DeepSpeed's `slurm` launcher starts every rank with one `srun -n TOTAL python -u SCRIPT`: Slurm gives each
process SLURM_PROCID, SLURM_LOCALID and SLURM_NTASKS, but nothing sets RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR or MASTER_PORT, which `deepspeed.init_distributed` and Accelerate read. The Slurm plan copies
this file into the run folder as `sitecustomize.py` and puts that folder on the job's PYTHONPATH (DeepSpeed
forwards PYTHON* variables to srun), so Python runs it at start-up in every rank and the training script is
left as it is. It imports nothing beyond the standard library and must stay self-contained.

Slurm's values win over RANK & co. already in the environment: the batch step itself has SLURM_PROCID=0,
so DeepSpeed's runner (a Python process in that step) gets RANK=0 and passes it on to every srun task.
"""

from __future__ import annotations

import os
import re
import sys

#: the batch script exports the head node's address and the port it picked under these names
HEAD_ADDRESS_VARIABLE = "PA_HEAD_ADDR"
PORT_VARIABLE = "PA_PORT"


def tasks_on_node(layout: str, node: int) -> int | None:
    """The task count of node `node` in Slurm's compressed layout ("2(x3),1" is 2, 2, 2, 1); None if unreadable."""
    counts: list[int] = []
    for part in layout.split(","):
        found = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if found is None:
            return None
        counts += [int(found.group(1))] * int(found.group(2) or 1)
    return counts[node] if 0 <= node < len(counts) else None


def rank_variables(environ) -> dict[str, str]:
    """The variables to set in a process srun started; empty outside a Slurm task."""
    if "SLURM_PROCID" not in environ or "SLURM_NTASKS" not in environ:
        return {}
    found = {"RANK": environ["SLURM_PROCID"], "WORLD_SIZE": environ["SLURM_NTASKS"],
             "LOCAL_RANK": environ.get("SLURM_LOCALID", "0")}
    layout = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or ""
    local_world = tasks_on_node(layout, int(environ.get("SLURM_NODEID", "0") or 0)) if layout else None
    if local_world is None and environ.get("SLURM_NTASKS_PER_NODE"):
        local_world = int(environ["SLURM_NTASKS_PER_NODE"])
    if local_world is not None:
        found["LOCAL_WORLD_SIZE"] = str(local_world)
    if environ.get(HEAD_ADDRESS_VARIABLE):
        found["MASTER_ADDR"] = environ[HEAD_ADDRESS_VARIABLE]
    if environ.get(PORT_VARIABLE):
        found["MASTER_PORT"] = environ[PORT_VARIABLE]
    return found


def _run_next_sitecustomize() -> None:
    """Python imports one sitecustomize, the first on sys.path: run the one this file hides (site-packages', a distro's)."""
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        candidate = os.path.join(os.path.abspath(entry or "."), "sitecustomize.py")
        if os.path.dirname(candidate) == here or not os.path.isfile(candidate):
            continue
        spec = importlib.util.spec_from_file_location("_sitecustomize_after_prefect_accelerate", candidate)
        if spec is not None and spec.loader is not None:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        return


if __name__ == "sitecustomize":
    os.environ.update(rank_variables(os.environ))
    _run_next_sitecustomize()
