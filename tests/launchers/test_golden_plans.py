"""Plans per mode pinned by golden files (tests/golden/launch/*.json)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.golden import assert_golden, normalize_plan

from prefect_accelerate.cli.main import build_parser
from prefect_accelerate.launchers import plan_launch
from prefect_accelerate.launchers.host import StaticHost
from prefect_accelerate.launchers.options import options_from_namespace

SAMPLES = Path(__file__).resolve().parent.parent / "fixtures" / "configs"
HOSTS = {
    "gpu8": StaticHost(kind="cuda", count=8, cores=32, python_path="PYTHON"),
    "cpu2": StaticHost(kind=None, count=0, cores=2, python_path="PYTHON"),
    "cpu2-openmpi": StaticHost(kind=None, count=0, cores=2, python_path="PYTHON", programs={"mpirun": "/usr/bin/mpirun"}, outputs={"mpirun --version": "mpirun (Open MPI) 4.1.4"}),
}
BASE = ["--mixed_precision", "no", "--dynamo_backend", "no", "--num_machines", "1"]
CASES = {
    "simple-cpu": ("cpu2", ["--cpu", "--num_processes", "1", *BASE, "train.py", "--lr", "3e-4"]),
    "torchrun-cpu-2": ("cpu2", ["--cpu", "--num_processes", "2", *BASE, "train.py"]),
    "multi-gpu-8-bf16": ("gpu8", ["--multi_gpu", "--num_processes", "8", "--mixed_precision", "bf16", "--dynamo_backend", "no", "--num_machines", "1", "train.py"]),
    "two-nodes-c10d-rank1": ("gpu8", ["--multi_gpu", "--num_processes", "16", "--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "10.0.0.1", "--main_process_port", "29500", "--rdzv_backend", "c10d", "--mixed_precision", "no", "--dynamo_backend", "no", "train.py"]),
    "fsdp2-parallelism": ("gpu8", ["--config_file", str(SAMPLES / "fsdp2_parallelism.yaml"), "train.py"]),
    "megatron": ("gpu8", ["--config_file", str(SAMPLES / "megatron.yaml"), "train.py"]),
    "mpirun-openmpi": ("cpu2-openmpi", ["--config_file", str(SAMPLES / "mpi_multicpu.yaml"), "train.py"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_matches_golden_file(name, tmp_path, monkeypatch):
    for variable in ("OMP_NUM_THREADS", "NCCL_P2P_DISABLE", "NCCL_IB_DISABLE"):
        monkeypatch.delenv(variable, raising=False)
    host_name, argv = CASES[name]
    host = HOSTS[host_name]
    run_dir = str(tmp_path / "run")
    args = build_parser().parse_args(["launch", "--run_dir", run_dir, *argv])
    options = options_from_namespace(args, host=host, environ={})
    plan = plan_launch(options, host, cwd=str(tmp_path))
    data = normalize_plan(plan.to_json_dict(), run_dir=run_dir, cwd=str(tmp_path))
    data["env"].pop("PYTHONUNBUFFERED", None)  # depends on the calling environment
    data["argv"] = [a.replace(str(SAMPLES), "SAMPLES") for a in data["argv"]]
    assert_golden(f"launch/{name}", data)
