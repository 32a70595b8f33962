"""The sitecustomize that gives srun-started ranks torch.distributed's variables (rank_env.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from prefect_accelerate.launchers.engines.slurm.deepspeed_runner import sitecustomize_source
from prefect_accelerate.launchers.engines.slurm.rank_env import rank_variables, tasks_on_node

TASK = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NODEID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "PA_HEAD_ADDR": "10.0.0.1", "PA_PORT": "41000"}


def test_slurm_task_variables_become_rank_world_size_and_the_head_address():
    assert rank_variables(TASK) == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                                    "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "41000"}


def test_outside_a_slurm_task_nothing_is_set():
    assert rank_variables({"RANK": "0", "PA_PORT": "1"}) == {}


def test_slurms_compressed_task_layout_is_read_per_node():
    assert [tasks_on_node("2(x3),1", node) for node in range(4)] == [2, 2, 2, 1]
    assert tasks_on_node("weird", 0) is None and tasks_on_node("2", 5) is None


def test_every_python_started_with_the_folder_on_pythonpath_gets_the_variables_and_the_next_sitecustomize_still_runs(tmp_path):
    site, user = tmp_path / "site", tmp_path / "user"
    site.mkdir()
    user.mkdir()
    (site / "sitecustomize.py").write_text(sitecustomize_source())
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = '1'\n")
    env = {**os.environ, **TASK, "RANK": "0", "WORLD_SIZE": "2", "PYTHONPATH": f"{site}:{user}"}
    code = "import json, os; print(json.dumps({k: os.environ.get(k) for k in ('RANK', 'WORLD_SIZE', 'MASTER_PORT', 'USER_SITE_RAN')}))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"RANK": "3", "WORLD_SIZE": "4", "MASTER_PORT": "41000", "USER_SITE_RAN": "1"}
