"""Parity with `accelerate launch` 1.16.0: the same environment and torchrun arguments for the same inputs.

For each case both tools see the same argv, config file and described machine (tests/helpers/oracle.py).
Differences are allowed only where docs/compatibility.md lists them, and each case that shows one pins
it exactly: a case states the variables or torchrun fields that must differ, and how.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

from helpers.oracle import accelerate_reference, torchrun_fields  # noqa: E402

from prefect_accelerate.cli.main import build_parser  # noqa: E402
from prefect_accelerate.launchers import plan_launch  # noqa: E402
from prefect_accelerate.launchers.host import StaticHost  # noqa: E402
from prefect_accelerate.launchers.options import options_from_namespace  # noqa: E402

SAMPLES = Path(__file__).resolve().parent.parent / "fixtures" / "configs"
GPU8 = dict(kind="cuda", count=8, cores=32)
CPU2 = dict(kind=None, count=0, cores=2)
#: variables we add for supervision (docs/compatibility.md, "Supervision"); never compared
OUR_SUPERVISION_ENV = {"TORCHELASTIC_ERROR_FILE", "PYTHONUNBUFFERED"}
MISSING = object()


@dataclass
class Case:
    id: str
    argv: str
    host: dict = field(default_factory=lambda: dict(GPU8))
    config: str | None = None  # a sample file name, or inline YAML when it contains a newline
    #: variables whose values must differ: name -> (ours, accelerate's); MISSING where one side lacks it
    env_diff: dict = field(default_factory=dict)
    #: torchrun fields that must differ: name -> (ours, accelerate's)
    torchrun_diff: dict = field(default_factory=dict)
    #: (ours, accelerate's) launcher names when they differ
    launcher_diff: tuple | None = None
    programs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)


INTEL_MPI = dict(programs={"mpirun": "/usr/bin/mpirun"}, outputs={"mpirun --version": "Intel(R) MPI Library for Linux* OS, Version 2021.10"})
OPEN_MPI = dict(programs={"mpirun": "/usr/bin/mpirun"}, outputs={"mpirun --version": "mpirun (Open MPI) 4.1.4"})

CASES = [
    # single process, the simple launcher
    Case("cpu-flag", "--cpu train.py --lr 1"),
    Case("cpu-bf16", "--cpu --num_processes 1 --mixed_precision bf16 train.py"),
    Case("single-dynamo", "--num_processes 1 --mixed_precision fp16 --dynamo_backend inductor --dynamo_mode max-autotune --dynamo_use_fullgraph --dynamo_use_dynamic train.py"),
    Case("single-gpu-ids", "--num_processes 1 --gpu_ids 1 --mixed_precision no train.py"),
    Case("single-debug-affinity", "--num_processes 1 --debug --enable_cpu_affinity train.py"),
    Case("single-threads", "--num_processes 1 --num_cpu_threads_per_process 4 train.py"),
    Case("fp8-defaults", "--num_processes 1 --mixed_precision fp8 train.py"),
    Case("fp8-te-flags", "--num_processes 1 --mixed_precision fp8 --fp8_backend te --fp8_format E4M3 --fp8_amax_history_len 16 --fp8_amax_compute_algo max --fp8_override_linear_precision true,false,true --fp8_margin 2 --fp8_use_autocast_during_eval train.py"),
    Case("module", "--num_processes 1 -m mypkg.train --epochs 2"),
    Case("no-python", "--num_processes 1 --no_python ./run.sh --fast"),
    Case("cpu-host-no-config", "train.py", host=dict(CPU2)),
    Case("mpirun-intel", "train.py --cpu", config="mpi_multicpu.yaml", host=dict(CPU2), **INTEL_MPI),
    Case("mpirun-openmpi", "train.py", config="mpi_multicpu.yaml", host=dict(CPU2), **OPEN_MPI),
    Case("simple-two-machines", "--num_processes 1 --num_machines 2 --main_process_ip 10.1.1.1 --main_process_port 1234 train.py"),
    # several processes through torchrun
    Case("multi-gpu-2", "--multi_gpu --num_processes 2 train.py --lr 1"),
    Case("multi-gpu-8-ids-bf16", "--multi_gpu --num_processes 8 --gpu_ids 0,1,2,3,4,5,6,7 --mixed_precision bf16 train.py"),
    Case("auto-multi-gpu", "--num_processes 4 train.py"),
    Case("two-nodes-same-network", "--multi_gpu --num_processes 8 --num_machines 2 --machine_rank 1 --main_process_ip 10.0.0.1 --main_process_port 29555 --same_network train.py"),
    Case("two-nodes-c10d", "--multi_gpu --num_processes 8 --num_machines 2 --machine_rank 0 --main_process_ip 10.0.0.1 --main_process_port 29556 --rdzv_backend c10d --rdzv_conf join_timeout=30 train.py"),
    Case("restarts-role", "--multi_gpu --num_processes 2 --max_restarts 3 --monitor_interval 1 --role trainer train.py"),
    Case("tee-logdir-given", "--multi_gpu --num_processes 2 --tee 3 --log_dir /tmp/rank-logs train.py"),
    Case("multi-gpu-module", "--multi_gpu --num_processes 2 -m pkg.train --x 1"),
    Case("multi-gpu-dynamo", "--multi_gpu --num_processes 2 --dynamo_backend eager --dynamo_use_regional_compilation train.py"),
    Case("multi-gpu-fp8-ao", "--multi_gpu --num_processes 2 --mixed_precision fp8 --fp8_backend ao --fp8_enable_fsdp_float8_all_gather false --fp8_pad_inner_dim false train.py"),
    Case("multi-gpu-debug-threads", "--multi_gpu --num_processes 2 --debug --num_cpu_threads_per_process 3 --enable_cpu_affinity train.py"),
    # FSDP
    Case("fsdp-defaults", "--use_fsdp --num_processes 2 train.py"),
    Case("fsdp1-all-flags", "--use_fsdp --num_processes 4 --fsdp_sharding_strategy SHARD_GRAD_OP --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap BertLayer --fsdp_backward_prefetch BACKWARD_POST --fsdp_state_dict_type SHARDED_STATE_DICT --fsdp_offload_params true --fsdp_activation_checkpointing true --mixed_precision bf16 train.py"),
    Case("fsdp2-flags", "--use_fsdp --num_processes 2 --fsdp_version 2 --fsdp_reshard_after_forward false --fsdp_auto_wrap_policy SIZE_BASED_WRAP --fsdp_min_num_params 1000 --fsdp_state_dict_type FULL_STATE_DICT train.py"),
    Case("fsdp2-parallelism", "--use_fsdp --num_processes 8 --fsdp_version 2 --use_parallelism_config --parallelism_config_tp_size 2 --parallelism_config_dp_shard_size 2 --parallelism_config_cp_size 2 --parallelism_config_cp_comm_strategy alltoall train.py"),
    Case("config-fsdp1", "train.py", config="fsdp1_current.yaml"),
    Case("config-fsdp2-parallelism", "train.py", config="fsdp2_parallelism.yaml"),
    Case("config-fsdp1-cli-wins", "--fsdp_sharding_strategy FULL_SHARD --fsdp_offload_params true --num_processes 2 train.py", config="fsdp1_current.yaml"),
    Case("config-unprefixed-fsdp-and-legacy-dynamo", "train.py", config="era3_dynamo_backend.yaml"),
    # Megatron-LM
    Case("megatron-flags", "--use_megatron_lm --num_processes 4 --megatron_lm_tp_degree 2 --megatron_lm_pp_degree 2 --megatron_lm_num_micro_batches 4 --megatron_lm_sequence_parallelism true --megatron_lm_recompute_activations true train.py"),
    Case("config-megatron", "train.py", config="megatron.yaml"),
    # configs of every era
    Case("config-fp16-era", "train.py", config="era1_fp16_flag.yaml"),
    Case("config-current-single", "train.py", config="current_single.yaml"),
    Case("config-dynamo-off-gpu-ids", "train.py", config="era3_dynamo_off.yaml"),
    Case("config-debug-cli-procs", "--num_processes 2 train.py", config="compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\ndebug: true\nnum_processes: 4\nmixed_precision: fp16\n"),
    Case("config-port-cli-wins", "--main_process_port 29999 --mixed_precision bf16 train.py", config="era1_fp16_flag.yaml"),
    Case("config-precision-from-file", "train.py", config="compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\nmixed_precision: bf16\n"),
    # listed differences, each pinned
    Case(
        "config-c10d-honoured", "train.py", config="multinode_c10d.json",
        torchrun_diff={"rdzv_backend": ("c10d", "static")},
    ),
    Case(
        "config-cpu-affinity-honoured", "train.py",
        config="compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\nenable_cpu_affinity: true\n",
        env_diff={"ACCELERATE_CPU_AFFINITY": ("1", MISSING)},
    ),
    Case(
        "config-same-network-honoured", "train.py",
        config="compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 4\nnum_machines: 2\nmachine_rank: 1\nmain_process_ip: 10.0.0.2\nmain_process_port: 29500\nsame_network: true\n",
        torchrun_diff={"master_addr": ("10.0.0.2", "127.0.0.1"), "master_port": (29500, None), "rdzv_endpoint": ("", "10.0.0.2:29500")},
    ),
    Case(
        "config-fp8-cli-keys", "train.py", config="fp8_cli_keys.yaml",
        env_diff={"ACCELERATE_FP8_OVERRIDE_FPROP": ("False", "("), "ACCELERATE_FP8_OVERRIDE_DGRAD": ("False", "f"), "ACCELERATE_FP8_OVERRIDE_WGRAD": ("False", "a")},
    ),
    Case(
        "config-fp8-questionnaire-keys", "train.py", config="fp8_questionnaire_keys.yaml",
        env_diff={
            "ACCELERATE_FP8_AMAX_HISTORY_LEN": ("256", "1024"), "ACCELERATE_FP8_AMAX_HISTORY_LENGTH": (MISSING, "256"),
            "ACCELERATE_FP8_AMAX_COMPUTE_ALGORITHM": (MISSING, "most_recent"),
        },
    ),
    Case(
        # Accelerate starts one process that reads MASTER_ADDR/PORT; torchrun gets the port as an argument and
        # sets both for each of its two workers
        "cpu-two-processes", "--cpu --num_processes 2 train.py", launcher_diff=("torchrun", "simple"),
        env_diff={"MASTER_ADDR": (MISSING, "127.0.0.1"), "MASTER_PORT": (MISSING, "29500")},
    ),
    Case(
        "cpu-host-multi-gpu", "--multi_gpu --num_processes 2 train.py", host=dict(CPU2),
        env_diff={"ACCELERATE_USE_CPU": ("True", MISSING), "KMP_AFFINITY": ("granularity=fine,compact,1,0", MISSING),
                  "KMP_BLOCKTIME": ("1", MISSING)},
    ),
]


def _config_path(case: Case, tmp_path: Path) -> str | None:
    if case.config is None:
        return None
    if "\n" in case.config:
        path = tmp_path / "inline.yaml"
        path.write_text(case.config)
        return str(path)
    suffix = Path(case.config).suffix
    path = tmp_path / f"config{suffix}"
    path.write_text((SAMPLES / case.config).read_text())
    return str(path)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("OMP_NUM_THREADS", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE", "NCCL_P2P_DISABLE", "NCCL_IB_DISABLE"):
        monkeypatch.delenv(name, raising=False)


def test_the_matrix_has_at_least_forty_cases():
    assert len(CASES) >= 40
    assert len({case.id for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_plan_matches_accelerate(case: Case, tmp_path):
    config = _config_path(case, tmp_path)
    argv = shlex.split(case.argv)
    if config:
        argv = ["--config_file", config, *argv]
    host = StaticHost(**case.host, programs=case.programs, outputs=case.outputs, python_path="PYTHON")
    reference = accelerate_reference(argv, host)

    args = build_parser().parse_args(["launch", *argv])
    options = options_from_namespace(args, environ=dict(os.environ), host=host)
    plan = plan_launch(options, host, cwd=str(tmp_path))

    ours_launcher = "torchrun" if plan.launcher.startswith("torchrun") else plan.launcher
    if case.launcher_diff:
        assert (ours_launcher, reference.launcher) == case.launcher_diff
        ours_env = {k: v for k, v in plan.env.items() if k not in OUR_SUPERVISION_ENV}
        theirs_env = {k: v for k, v in reference.env.items() if k != "PYTHONUNBUFFERED"}
        for name, (ours_value, theirs_value) in case.env_diff.items():
            assert ours_env.pop(name, MISSING) == ours_value, name
            assert theirs_env.pop(name, MISSING) == theirs_value, name
        assert ours_env == theirs_env
        return
    assert ours_launcher in (reference.launcher, "mpirun")

    ours_env = {k: v for k, v in plan.env.items() if k not in OUR_SUPERVISION_ENV}
    theirs_env = dict(reference.env)
    if reference.launcher == "simple":
        theirs_env.pop("PYTHONUNBUFFERED", None)
    for name, (ours_value, theirs_value) in case.env_diff.items():
        assert ours_env.pop(name, MISSING) == ours_value, name
        assert theirs_env.pop(name, MISSING) == theirs_value, name
    assert ours_env == theirs_env

    if reference.launcher == "simple":
        assert [("PYTHON" if part == host.python() else part) for part in plan.argv] == [
            ("PYTHON" if part.endswith("python") or "python3" in part else part) for part in reference.cmd
        ]
        return
    ours_fields = torchrun_fields(list(plan.argv))
    theirs_fields = dict(reference.torchrun)
    given = set(options.given)
    if "tee" not in given:
        assert ours_fields.pop("tee") == "3" and theirs_fields.pop("tee") == "0"
    if "log_dir" not in given:
        assert ours_fields.pop("log_dir") == str(Path(options.run_dir or plan.run_dir) / "ranks")
        assert theirs_fields.pop("log_dir") is None
    for name, (ours_value, theirs_value) in case.torchrun_diff.items():
        assert ours_fields.pop(name) == ours_value, name
        assert theirs_fields.pop(name) == theirs_value, name
    assert ours_fields == theirs_fields


def test_port_zero_picks_a_free_port_in_both():
    host = StaticHost(**GPU8, next_free_port=40123)
    argv = ["--multi_gpu", "--num_processes", "2", "--main_process_port", "0", "train.py"]
    reference = accelerate_reference(argv, host)
    plan = plan_launch(options_from_namespace(build_parser().parse_args(["launch", *argv]), host=host), host)
    assert reference.torchrun["master_port"] not in ("0", None)
    assert torchrun_fields(list(plan.argv))["master_port"] == 40123
