"""DeepSpeed launch plans: the checks made before launch, the per-run .deepspeed_env, and --dry-run output.

Everything here is planning: nothing starts. Parity with Accelerate is in test_deepspeed_parity.py, real
runs in test_deepspeed_runs.py, DeepSpeed's own runner commands in test_deepspeed_golden.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from prefect_accelerate.errors import ConfigError, DependencyError, LaunchError, UsageError
from prefect_accelerate.launchers.engines.deepspeed import plan as ds
from prefect_accelerate.launchers import plan_launch
from prefect_accelerate.launchers.host import StaticHost
from prefect_accelerate.launchers.options import build_launch_options

GPU8 = dict(kind="cuda", count=8, cores=32, python_path="PYTHON")
ALL_PROGRAMS = {name: f"/usr/bin/{name}" for name in ("pdsh", "ompi_info", "mpirun", "sinfo", "mpiname")}
TWO_NODES = dict(use_deepspeed=True, num_processes=4, num_machines=2, machine_rank=0, main_process_ip="10.0.0.1",
                 main_process_port=29600, mixed_precision="no", dynamo_backend="no")


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DS_ENV_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hostfile").write_text("node1 slots=2\nnode2 slots=2\n")


def make_plan(tmp_path, *, host=None, **flags):
    options = build_launch_options("train.py", ["--lr", "1"], host=host or StaticHost(**GPU8, programs=ALL_PROGRAMS),
                                   run_dir=str(tmp_path / "run"), **flags)
    return plan_launch(options, host or StaticHost(**GPU8, programs=ALL_PROGRAMS), cwd=str(tmp_path))


# ---------------------------------------------------------------------------------------------------
# hostfile and filters in a launch (their rules: test_hostfile.py)


def test_a_missing_or_bad_hostfile_stops_the_launch_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="needs a DeepSpeed hostfile"):
        make_plan(tmp_path, **TWO_NODES)
    with pytest.raises(ConfigError, match="The DeepSpeed hostfile nope does not exist"):
        make_plan(tmp_path, deepspeed_hostfile="nope", **TWO_NODES)
    (tmp_path / "bad").write_text("node1 slots=2\nnode1 slots=2\n")
    with pytest.raises(ConfigError, match="bad, line 2: host node1 is listed again"):
        make_plan(tmp_path, deepspeed_hostfile="bad", **TWO_NODES)
    with pytest.raises(ConfigError, match="leaves no host"):
        make_plan(tmp_path, deepspeed_hostfile="hostfile", deepspeed_exclusion_filter="node1@node2", **TWO_NODES)


def test_a_hostfile_that_disagrees_with_the_process_count_is_a_warning(tmp_path):
    (tmp_path / "three").write_text("a slots=2\nb slots=2\nc slots=2\n")
    plan = make_plan(tmp_path, deepspeed_hostfile="three", **TWO_NODES)
    assert any("will start 6 process(es) on 3 host(s)" in w for w in plan.warnings)
    assert "DeepSpeed will start 6 process(es) on 3 host(s): a (2), b (2), c (2)." in plan.notes


def test_mpi_launchers_refuse_filters_and_unequal_slots(tmp_path):
    with pytest.raises(ConfigError, match="openmpi launcher cannot use a DeepSpeed inclusion or exclusion filter"):
        make_plan(tmp_path, deepspeed_hostfile="hostfile", deepspeed_multinode_launcher="openmpi",
                  deepspeed_exclusion_filter="node2", **TWO_NODES)
    (tmp_path / "uneven").write_text("a slots=2\nb slots=1\n")
    with pytest.raises(ConfigError, match="mpich launcher needs the same slots on every host"):
        make_plan(tmp_path, deepspeed_hostfile="uneven", deepspeed_multinode_launcher="mpich", **TWO_NODES)


def test_slurm_filters_must_keep_the_first_slots_of_every_host(tmp_path):
    with pytest.raises(ConfigError, match=r"slurm launcher places processes by count.*node1 slots \[0, 1\], node2 slots \[1\]"):
        make_plan(tmp_path, deepspeed_hostfile="hostfile", deepspeed_multinode_launcher="slurm",
                  deepspeed_exclusion_filter="node2:0", **TWO_NODES)
    plan = make_plan(tmp_path, deepspeed_hostfile="hostfile", deepspeed_multinode_launcher="slurm",
                     deepspeed_inclusion_filter="node1:0@node2:0", **TWO_NODES)
    assert "--include" in plan.argv


def test_nossh_needs_the_main_address(tmp_path):
    with pytest.raises(UsageError, match="nossh launcher needs --main_process_ip"):
        make_plan(tmp_path, deepspeed_hostfile="hostfile", deepspeed_multinode_launcher="nossh",
                  **{**TWO_NODES, "main_process_ip": None})


def test_nossh_machine_rank_must_name_a_host(tmp_path):
    with pytest.raises(ConfigError, match="machine_rank is 1, .* has 1 host"):
        make_plan(tmp_path, deepspeed_hostfile="hostfile", deepspeed_multinode_launcher="nossh",
                  deepspeed_inclusion_filter="node1", **{**TWO_NODES, "machine_rank": 1})


# ---------------------------------------------------------------------------------------------------
# launcher choice, programs, versions


def test_unknown_launcher_and_missing_program_are_clear_errors(tmp_path):
    with pytest.raises(UsageError, match="Unknown deepspeed_multinode_launcher 'ssh'"):
        make_plan(tmp_path, deepspeed_hostfile="hostfile", deepspeed_multinode_launcher="ssh", **TWO_NODES)
    one_machine = make_plan(tmp_path, use_deepspeed=True, num_processes=2, deepspeed_multinode_launcher="ssh")
    assert one_machine.launcher == "torchrun-deepspeed"  # unused on one machine, as in Accelerate
    bare = StaticHost(**GPU8)
    with pytest.raises(LaunchError, match="only when `sinfo` is on PATH"):
        make_plan(tmp_path, host=bare, deepspeed_hostfile="hostfile", deepspeed_multinode_launcher="slurm", **TWO_NODES)
    assert make_plan(tmp_path, host=bare, deepspeed_hostfile="hostfile", deepspeed_multinode_launcher="nossh", **TWO_NODES)


def test_deepspeed_missing_or_too_old_for_nossh(tmp_path, monkeypatch):
    monkeypatch.setattr(ds, "installed_deepspeed_version", lambda: (0, 14, 4))
    with pytest.raises(DependencyError, match="nossh launcher needs DeepSpeed 0.14.5 or newer"):
        make_plan(tmp_path, deepspeed_hostfile="hostfile", deepspeed_multinode_launcher="nossh", **TWO_NODES)
    monkeypatch.setattr(ds, "installed_deepspeed_version", lambda: None)
    with pytest.raises(DependencyError, match=r"pip install 'prefect-accelerate\[deepspeed\]'"):
        make_plan(tmp_path, use_deepspeed=True, num_processes=2)


def test_machine_rank_defaults_to_zero_where_accelerate_crashes(tmp_path):
    # Accelerate 1.16 computes int(args.machine_rank) for its port check and raises TypeError on None
    flags = {k: v for k, v in TWO_NODES.items() if k != "machine_rank"}
    plan = make_plan(tmp_path, deepspeed_hostfile="hostfile", **flags)
    assert plan.machine_rank == 0 and plan.launcher == "deepspeed-pdsh"


def test_a_busy_port_on_the_main_machine_is_refused(tmp_path):
    host = StaticHost(**GPU8, programs=ALL_PROGRAMS, busy_ports={29600})
    with pytest.raises(LaunchError, match="Port 29600 on this machine is already in use"):
        make_plan(tmp_path, host=host, deepspeed_hostfile="hostfile", **TWO_NODES)


# ---------------------------------------------------------------------------------------------------
# the DeepSpeed JSON file


def test_json_file_problems_are_found_before_launch(tmp_path):
    one = dict(use_deepspeed=True, num_processes=2, mixed_precision="no", dynamo_backend="no", num_machines=1)
    with pytest.raises(ConfigError, match="The DeepSpeed config file missing.json does not exist"):
        make_plan(tmp_path, deepspeed_config_file="missing.json", **one)
    (tmp_path / "broken.json").write_text('{"zero_optimization": {"stage": 2},\n  oops}')
    with pytest.raises(ConfigError, match=r"broken.json is not valid JSON \(line 2, column 3"):
        make_plan(tmp_path, deepspeed_config_file="broken.json", **one)
    (tmp_path / "nozero.json").write_text('{"train_batch_size": 8}')
    with pytest.raises(ConfigError, match="has no zero_optimization section"):
        make_plan(tmp_path, deepspeed_config_file="nozero.json", **one)
    (tmp_path / "fp16.json").write_text('{"zero_optimization": {"stage": 2}, "fp16": {"enabled": true}}')
    with pytest.raises(ConfigError, match="mixed_precision is bf16 but the DeepSpeed config file fp16.json enables fp16"):
        make_plan(tmp_path, deepspeed_config_file="fp16.json", **{**one, "mixed_precision": "bf16"})
    assert make_plan(tmp_path, deepspeed_config_file="fp16.json", **{**one, "mixed_precision": "fp16"})
    (tmp_path / "both.json").write_text('{"zero_optimization": {"stage": 2}, "fp16": {"enabled": true}, "bf16": {"enabled": "true"}}')
    with pytest.raises(ConfigError, match="both.json enables both fp16 and bf16"):
        make_plan(tmp_path, deepspeed_config_file="both.json", **one)


def test_a_config_with_a_json_file_and_top_level_precision_is_refused_before_launch(tmp_path):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3}}')
    config = tmp_path / "multi.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\nmixed_precision: bf16\n")
    with pytest.raises(ConfigError, match=f"{config} sets mixed_precision while the DeepSpeed JSON file ds.json is used"):
        make_plan(tmp_path, config_file=str(config), use_deepspeed=True, deepspeed_config_file="ds.json")
    plan = make_plan(tmp_path, config_file=str(config), use_deepspeed=True, deepspeed_config_file="ds.json", mixed_precision="bf16")
    assert plan.env["ACCELERATE_CONFIG_DS_FIELDS"] == ""  # passed on the command line, so the plugin accepts it


# ---------------------------------------------------------------------------------------------------
# environment and .deepspeed_env


def test_nvme_offload_paths_reach_the_script(tmp_path):
    plan = make_plan(tmp_path, use_deepspeed=True, num_processes=2, zero_stage=3, offload_param_device="nvme",
                     offload_param_nvme_path="/nvme/p", offload_optimizer_device="nvme", offload_optimizer_nvme_path="/nvme/o")
    assert plan.env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH"] == "/nvme/p"
    assert plan.env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH"] == "/nvme/o"
    assert plan.launcher == "torchrun-deepspeed" and "torch.distributed.run" in plan.argv


def test_deepspeed_env_file_lives_in_the_run_folder_and_keeps_secrets_out(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_SOCKET_IFNAME=eth1\nHF_TOKEN=hf_abcdef\nMY_DB_PASSWORD=pw\n")
    (tmp_path / ".deepspeed_env").write_text("NCCL_SOCKET_IFNAME=ib0\nWANDB_PROJECT=demo\n")
    before = (tmp_path / ".deepspeed_env").read_text()
    plan = make_plan(tmp_path, deepspeed_hostfile="hostfile", zero_stage=2, deepspeed_moe_layer_cls_names="A B", **TWO_NODES)

    env_file = str(tmp_path / "run" / ".deepspeed_env")
    assert plan.env["DS_ENV_FILE"] == env_file
    content = plan.files[env_file]
    lines = dict(line.split("=", 1) for line in content.splitlines())
    assert lines["NCCL_SOCKET_IFNAME"] == "ib0"  # ./ read after ~/, as DeepSpeed reads them
    assert lines["WANDB_PROJECT"] == "demo"
    assert lines["ACCELERATE_USE_DEEPSPEED"] == "true" and lines["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2"
    assert lines["PYTHONPATH"].endswith(str(tmp_path))
    assert not {"HF_TOKEN", "MY_DB_PASSWORD", "DS_ENV_FILE", "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"} & set(lines)
    assert "hf_abcdef" not in content and "pw" not in lines.values()
    assert any("HF_TOKEN, MY_DB_PASSWORD" in w and "never written" in w for w in plan.warnings)
    assert any("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES" in w and "contain a space" in w for w in plan.warnings)
    assert all("hf_abcdef" not in text for text in (*plan.warnings, *plan.notes))
    assert (tmp_path / ".deepspeed_env").read_text() == before  # the user's file is never touched


def test_a_user_chosen_ds_env_file_is_carried_over(tmp_path, monkeypatch):
    (tmp_path / "cluster.env").write_text("NCCL_DEBUG=INFO\n")
    monkeypatch.setenv("DS_ENV_FILE", "cluster.env")
    plan = make_plan(tmp_path, deepspeed_hostfile="hostfile", **TWO_NODES)
    assert "NCCL_DEBUG=INFO\n" in plan.files[plan.env["DS_ENV_FILE"]]
    assert plan.env["DS_ENV_FILE"] == str(tmp_path / "run" / ".deepspeed_env")


def test_nossh_writes_no_env_file_because_the_runner_reads_none(tmp_path):
    plan = make_plan(tmp_path, deepspeed_hostfile="hostfile", deepspeed_multinode_launcher="nossh", **TWO_NODES)
    assert plan.files == {} and "DS_ENV_FILE" not in plan.env
    assert plan.argv[3:9] == ("--hostfile", "hostfile", "--node_rank", "0", "--no_ssh", "--num_gpus")


def test_planning_twice_gives_the_same_plan_and_leaves_options_alone(tmp_path):
    options = build_launch_options("train.py", host=StaticHost(**GPU8, programs=ALL_PROGRAMS), run_dir=str(tmp_path / "run"),
                                   deepspeed_hostfile="hostfile", **TWO_NODES)
    snapshot = options.model_dump()
    host = StaticHost(**GPU8, programs=ALL_PROGRAMS)
    assert plan_launch(options, host, cwd=str(tmp_path)) == plan_launch(options, host, cwd=str(tmp_path))
    assert options.model_dump() == snapshot


# ---------------------------------------------------------------------------------------------------
# --dry-run --json through the CLI, for every launcher kind


@pytest.mark.parametrize("launcher", ["single", "standard", "pdsh", "openmpi", "mpich", "impi", "mvapich", "slurm", "nossh"])
def test_dry_run_json_shows_the_runner_command_and_env(tmp_path, launcher):
    fake = tmp_path / "bin"
    fake.mkdir()
    for name in ALL_PROGRAMS:
        (fake / name).write_text("#!/bin/sh\nexit 0\n")
        (fake / name).chmod(0o755)
    argv = ["--use_deepspeed", "--zero_stage", "2", "--mixed_precision", "bf16", "--dynamo_backend", "no"]
    if launcher == "single":
        argv += ["--num_processes", "2", "--num_machines", "1"]
    else:
        argv += ["--num_processes", "4", "--num_machines", "2", "--machine_rank", "0", "--main_process_ip", "127.0.0.1",
                 "--deepspeed_hostfile", "hostfile", "--deepspeed_multinode_launcher", launcher]
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "HF_TOKEN": "hf_secret_value"}
    (tmp_path / "train.py").write_text("print('train')\n")
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "prefect_accelerate.cli.main", "launch", "--dry-run", "--json",
         "--run_dir", str(tmp_path / "run"), *argv, "train.py", "--lr", "1"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["env"]["ACCELERATE_USE_DEEPSPEED"] == "true" and data["env"]["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert data["argv"][-3:] == ["train.py", "--lr", "1"]
    if launcher in ("single", "standard"):
        assert data["launcher"] == "torchrun-deepspeed" and data["argv"][1:3] == ["-m", "torch.distributed.run"]
    else:
        assert data["launcher"] == f"deepspeed-{launcher}" and data["argv"][1:3] == ["-m", "deepspeed.launcher.runner"]
        assert ("--no_ssh" in data["argv"]) == (launcher == "nossh")
        assert ("--num_gpus" in data["argv"]) == (launcher not in ds.MPI_LAUNCHERS)
    if launcher not in ("single", "standard", "nossh"):
        (path, content), = data["files"].items()
        assert path == data["env"]["DS_ENV_FILE"] == str(tmp_path / "run" / ".deepspeed_env")
        assert "ACCELERATE_DEEPSPEED_ZERO_STAGE=2\n" in content and "hf_secret_value" not in content
    assert not (tmp_path / ".deepspeed_env").exists() and not (tmp_path / "run").exists()
    imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert not {"torch", "deepspeed", "prefect"} & imported
