"""Parity with `accelerate launch --use_deepspeed` 1.16.0: the same environment and command for the same inputs.

Both tools see the same argv, config file, hostfile, working directory and described machine
(tests/helpers/ds_oracle.py). Differences are allowed only where docs/compatibility.md lists them:
- everywhere: the runner is `<python> -m deepspeed.launcher.runner` where Accelerate runs `deepspeed`
  from PATH; our supervision variables (PYTHONUNBUFFERED, TORCHELASTIC_ERROR_FILE, DS_ENV_FILE); and the
  torchrun --tee/--log_dir defaults of tests/launchers/test_parity.py;
- per case, pinned exactly: variables (`env_diff`), runner arguments (`argv_diff`), or a refusal before
  launch where Accelerate builds a command that fails later (`refused`, with the proof in Accelerate's output).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

from helpers.ds_oracle import accelerate_deepspeed_reference  # noqa: E402
from helpers.oracle import torchrun_fields  # noqa: E402

from prefect_accelerate.cli.main import build_parser  # noqa: E402
from prefect_accelerate.errors import PrefectAccelerateError  # noqa: E402
from prefect_accelerate.launchers import plan_launch  # noqa: E402
from prefect_accelerate.launchers.host import StaticHost  # noqa: E402
from prefect_accelerate.launchers.options import options_from_namespace  # noqa: E402

SAMPLES = Path(__file__).resolve().parents[3] / "fixtures" / "configs"
GPU8 = dict(kind="cuda", count=8, cores=32)
CPU2 = dict(kind=None, count=0, cores=2)
RUNNER = ["PYTHON", "-m", "deepspeed.launcher.runner"]
OUR_SUPERVISION_ENV = {"TORCHELASTIC_ERROR_FILE", "PYTHONUNBUFFERED", "DS_ENV_FILE"}
MISSING = object()
PDSH = {"pdsh": "/usr/bin/pdsh"}
HOSTS2x2 = "node1 slots=2\nnode2 slots=2\n"
MULTI = ("--use_deepspeed --num_processes 4 --num_machines 2 --machine_rank 0 --deepspeed_hostfile hostfile "
         "--main_process_ip 10.0.0.1 --main_process_port 29600")


@dataclass
class Case:
    id: str
    argv: str
    host: dict = field(default_factory=lambda: dict(GPU8))
    config: str | None = None  # a sample file name, or inline YAML when it contains a newline
    files: dict = field(default_factory=dict)  # written into the working directory
    programs: dict = field(default_factory=dict)
    env_diff: dict = field(default_factory=dict)  # name -> (ours, accelerate's); MISSING where one side lacks it
    argv_diff: tuple = ()  # runner arguments Accelerate has and we leave out
    torchrun_diff: dict = field(default_factory=dict)
    refused: str | None = None  # our error (regex) where Accelerate builds a launch that fails later
    accelerate_proof: dict = field(default_factory=dict)  # for refused cases: what in Accelerate's output fails


NVME = {
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH": ("/nvme/opt", MISSING),
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH": ("/nvme/param", MISSING),
}
DS_JSON = {"ds.json": '{"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}'}

CASES = [
    # one machine: torchrun with the DeepSpeed environment
    Case("zero2-flags", "--use_deepspeed --num_processes 2 --zero_stage 2 train.py --lr 1"),
    Case("zero3-cpu-offload-all-flags",
         "--use_deepspeed --num_processes 4 --zero_stage 3 --offload_optimizer_device cpu --offload_param_device CPU "
         "--zero3_init_flag true --zero3_save_16bit_model True --gradient_accumulation_steps 4 --gradient_clipping 1.0 "
         "--mixed_precision bf16 train.py"),
    Case("zero3-nvme-offload",
         "--use_deepspeed --num_processes 2 --zero_stage 3 --offload_optimizer_device nvme --offload_optimizer_nvme_path "
         "/nvme/opt --offload_param_device nvme --offload_param_nvme_path /nvme/param train.py", env_diff=NVME),
    Case("json-config-file-flag", "--use_deepspeed --num_processes 2 --deepspeed_config_file ds.json --mixed_precision bf16 train.py", files=DS_JSON),
    Case("json-config-file-from-config", "train.py", config="deepspeed_json_file.yaml", files={"ds_config.json": '{"zero_optimization": {"stage": 3}}'}),
    Case("moe-debug-gpu-ids-affinity",
         "--use_deepspeed --num_processes 2 --gpu_ids 0,1 --debug --enable_cpu_affinity "
         "--deepspeed_moe_layer_cls_names MixtralSparseMoeBlock,Other train.py"),
    Case("fp8-te", "--use_deepspeed --num_processes 2 --mixed_precision fp8 --fp8_backend te --fp8_format E4M3 train.py"),
    Case("module", "--use_deepspeed --num_processes 2 -m pkg.train --x 1"),
    Case("cpu-only-host", "--use_deepspeed --num_processes 2 --zero_stage 1 train.py", host=dict(CPU2)),
    Case("config-zero-stage-cli-wins",
         "--zero_stage 3 train.py",
         config="compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_processes: 2\nmixed_precision: fp16\n"
                "deepspeed_config:\n  zero_stage: 2\n  gradient_accumulation_steps: 2\n  offload_optimizer_device: cpu\n",
         # the same names, sorted rather than in the file's order (Accelerate's plugin only tests membership)
         env_diff={"ACCELERATE_CONFIG_DS_FIELDS": ("gradient_accumulation_steps,offload_optimizer_device,zero_stage,mixed_precision",
                                                   "zero_stage,gradient_accumulation_steps,offload_optimizer_device,mixed_precision")}),
    # several machines through torchrun (standard)
    Case("standard-same-network",
         "--use_deepspeed --num_processes 8 --num_machines 2 --machine_rank 1 --deepspeed_multinode_launcher standard "
         "--main_process_ip 10.0.0.1 --main_process_port 29555 --same_network --zero_stage 2 train.py"),
    Case("standard-c10d",
         "--use_deepspeed --num_processes 4 --num_machines 2 --machine_rank 0 --deepspeed_multinode_launcher standard "
         "--main_process_ip 10.0.0.1 --main_process_port 29556 --rdzv_backend c10d train.py"),
    # several machines through DeepSpeed's runner
    Case("pdsh-default", f"{MULTI} --zero_stage 2 train.py --lr 1", files={"hostfile": HOSTS2x2}, programs=PDSH),
    Case("pdsh-include-module", f"{MULTI} --deepspeed_inclusion_filter node1:0,1 --module mypkg.train --lr 1",
         files={"hostfile": HOSTS2x2}, programs=PDSH),
    Case("pdsh-exclude-slot", f"{MULTI} --deepspeed_exclusion_filter node2:1 train.py", files={"hostfile": HOSTS2x2}, programs=PDSH),
    Case("pdsh-both-filters-exclusion-wins",
         f"{MULTI} --deepspeed_exclusion_filter node2 --deepspeed_inclusion_filter node1 train.py",
         files={"hostfile": HOSTS2x2}, programs=PDSH),
    Case("pdsh-config-zero3-nvme", "train.py", config="deepspeed_zero3_multinode.yaml",
         files={"hostfile": "node1 slots=8\nnode2 slots=8\n"}, programs=PDSH, env_diff=NVME),
    Case("nossh-rank1", MULTI.replace("--machine_rank 0", "--machine_rank 1") + " --deepspeed_multinode_launcher nossh train.py", files={"hostfile": HOSTS2x2}),
    Case("slurm", f"{MULTI} --deepspeed_multinode_launcher slurm --no_python ./run.sh", files={"hostfile": HOSTS2x2},
         programs={"sinfo": "/usr/bin/sinfo"}),
    Case("openmpi", f"{MULTI} --deepspeed_multinode_launcher openmpi train.py", files={"hostfile": HOSTS2x2},
         programs={"ompi_info": "/usr/bin/ompi_info"}, argv_diff=("--num_gpus", "2")),
    Case("mpich", f"{MULTI} --deepspeed_multinode_launcher mpich train.py", files={"hostfile": HOSTS2x2},
         programs={"mpirun": "/usr/bin/mpirun"}, argv_diff=("--num_gpus", "2")),
    Case("impi", f"{MULTI} --deepspeed_multinode_launcher impi train.py", files={"hostfile": HOSTS2x2},
         programs={"mpirun": "/usr/bin/mpirun"}, argv_diff=("--num_gpus", "2")),
    Case("mvapich", f"{MULTI} --deepspeed_multinode_launcher mvapich train.py", files={"hostfile": HOSTS2x2},
         programs={"mpiname": "/usr/bin/mpiname"}, argv_diff=("--num_gpus", "2")),
    # refused before launch; Accelerate builds a launch that fails later
    Case("refused-json-file-with-config-precision",
         "--use_deepspeed --deepspeed_config_file ds.json train.py", files=DS_JSON,
         config="compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\nmixed_precision: fp16\n",
         refused="sets mixed_precision while the DeepSpeed JSON file",
         accelerate_proof={"ACCELERATE_CONFIG_DS_FIELDS": "mixed_precision", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds.json"}),
    Case("refused-json-file-with-config-zero-stage",
         "--deepspeed_config_file ds.json --mixed_precision no train.py", files=DS_JSON,
         config="compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 2\n",
         refused="sets zero_stage while the DeepSpeed JSON file",
         accelerate_proof={"ACCELERATE_CONFIG_DS_FIELDS": "zero_stage", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds.json"}),
    Case("refused-pdsh-without-hostfile", "--use_deepspeed --num_processes 4 --num_machines 2 --machine_rank 0 --main_process_ip 10.0.0.1 train.py",
         programs=PDSH, refused="needs a DeepSpeed hostfile", accelerate_proof={"cmd": ["--hostfile", "None"]}),
    Case("refused-openmpi-with-filter", f"{MULTI} --deepspeed_multinode_launcher openmpi --deepspeed_inclusion_filter node1 train.py",
         files={"hostfile": HOSTS2x2}, programs={"ompi_info": "/usr/bin/ompi_info"},
         refused="cannot use a DeepSpeed inclusion or exclusion filter", accelerate_proof={"cmd": ["--include", "node1"]}),
]


def _config_path(case: Case, tmp_path: Path) -> str | None:
    if case.config is None:
        return None
    text = case.config if "\n" in case.config else (SAMPLES / case.config).read_text().replace("/job/hostfile", "hostfile")
    path = tmp_path / ("config" + (".yaml" if "\n" in case.config else Path(case.config).suffix))
    path.write_text(text)
    return str(path)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    for name in ("OMP_NUM_THREADS", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE",
                 "NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "DS_ENV_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.deepspeed_env of the person running the tests
    monkeypatch.chdir(tmp_path)  # Accelerate puts abspath(".") on PYTHONPATH


def test_the_matrix_has_at_least_fifteen_cases():
    assert len([case for case in CASES if not case.refused]) >= 15
    assert len({case.id for case in CASES}) == len(CASES)


def _plan(case: Case, tmp_path: Path):
    for name, content in case.files.items():
        (tmp_path / name).write_text(content)
    config = _config_path(case, tmp_path)
    argv = shlex.split(case.argv)
    if config:
        argv = ["--config_file", config, *argv]
    host = StaticHost(**case.host, programs=case.programs, python_path="PYTHON")
    reference = accelerate_deepspeed_reference(argv, host)
    options = options_from_namespace(build_parser().parse_args(["launch", *argv]), environ=dict(os.environ), host=host)
    return reference, options, host, argv


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_plan_matches_accelerate(case: Case, tmp_path):
    reference, options, host, _ = _plan(case, tmp_path)
    if case.refused:
        with pytest.raises(PrefectAccelerateError, match=case.refused):
            plan_launch(options, host, cwd=str(tmp_path))
        for name, proof in case.accelerate_proof.items():
            if name == "cmd":
                joined = " ".join(reference.cmd)
                assert " ".join(proof) in joined, joined
            else:
                assert proof in reference.env[name], (name, reference.env[name])
        return
    plan = plan_launch(options, host, cwd=str(tmp_path))

    ours_env = {k: v for k, v in plan.env.items() if k not in OUR_SUPERVISION_ENV}
    theirs_env = dict(reference.env)
    for name, (ours_value, theirs_value) in case.env_diff.items():
        assert ours_env.pop(name, MISSING) == ours_value, name
        assert theirs_env.pop(name, MISSING) == theirs_value, name
    assert ours_env == theirs_env

    if reference.launcher == "deepspeed":
        assert plan.launcher.startswith("deepspeed-")
        ours = list(plan.argv)
        assert ours[:3] == RUNNER and reference.cmd[0] == "deepspeed"
        theirs = reference.cmd[1:]
        if case.argv_diff:
            at = next(i for i in range(len(theirs)) if tuple(theirs[i:i + len(case.argv_diff)]) == case.argv_diff)
            theirs = theirs[:at] + theirs[at + len(case.argv_diff):]
        assert ours[3:] == theirs
        if "--no_ssh" not in ours:
            assert plan.env["DS_ENV_FILE"] == str(Path(plan.run_dir) / ".deepspeed_env")
        return

    assert plan.launcher == "torchrun-deepspeed" and not case.argv_diff
    ours_fields = torchrun_fields(list(plan.argv))
    theirs_fields = dict(reference.torchrun)
    if "tee" not in options.given:
        assert ours_fields.pop("tee") == "3" and theirs_fields.pop("tee") == "0"
    if "log_dir" not in options.given:
        assert ours_fields.pop("log_dir") == str(Path(plan.run_dir) / "ranks")
        assert theirs_fields.pop("log_dir") is None
    for name, (ours_value, theirs_value) in case.torchrun_diff.items():
        assert ours_fields.pop(name) == ours_value, name
        assert theirs_fields.pop(name) == theirs_value, name
    assert ours_fields == theirs_fields


def test_parallelism_config_with_deepspeed_is_refused_by_both(tmp_path):
    argv = shlex.split("--use_deepspeed --num_processes 4 --zero_stage 2 --use_parallelism_config "
                       "--parallelism_config_dp_replicate_size 2 train.py")
    host = StaticHost(python_path="PYTHON")
    with pytest.raises(ValueError, match="--use_parallelism_config` without `--use_fsdp`"):
        accelerate_deepspeed_reference(argv, host)
    with pytest.raises(PrefectAccelerateError, match="needs FSDP version 2"):  # refused while merging the options
        plan_launch(options_from_namespace(build_parser().parse_args(["launch", *argv]), environ=dict(os.environ), host=host),
                    host, cwd=str(tmp_path))
