"""`prefect-accelerate config`: the questionnaire driven by typed answers, for every branch.

Each scenario feeds answers through the input function (as a user types them), then checks the file:
its content, that our loader reads it back unchanged, that Accelerate 1.16's own loader reads the same
values, and, for the scenarios Accelerate can answer too, that its questionnaire given the same
answers writes the same config apart from the differences listed in docs/compatibility.md.
A few scenarios run end to end through `python -m prefect_accelerate.cli.main config` with stdin.
"""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prefect_accelerate.config.io import load_config_path
from prefect_accelerate.config.questionnaire import QUESTIONS, run_questionnaire
from prefect_accelerate.config.questions import Environment, QuestionnaireInterrupted, ask
from prefect_accelerate.config.questions.sagemaker import SAGEMAKER_ROLE_NAME, iam_client
from prefect_accelerate.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
EVERYTHING = frozenset({"deepspeed", "transformers", "transformer_engine", "torchao", "boto3"})


class Script:
    """Typed answers handed out one prompt at a time, as a user would type them (never echoed)."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.prompts: list[str] = []

    def __call__(self, prompt: str) -> str:
        self.prompts.append(prompt)
        if not self.answers:
            raise EOFError
        return self.answers.pop(0)


def env(accelerator="cuda", modules=EVERYTHING, **kw) -> Environment:
    return Environment(accelerator, has_module=lambda name: name in modules, platform=kw.pop("platform", "linux"), **kw)


def configure(tmp_path, answers, *, name="config.yaml", **env_kw):
    """Run the questionnaire on `answers`; returns (file content, transcript, path). Every answer must be used."""
    script, out = Script(answers), io.StringIO()
    path = run_questionnaire(tmp_path / name, input_fn=script, out=out, env=env(**env_kw))
    assert script.answers == [], f"unused answers: {script.answers}"
    text = path.read_text()
    data = json.loads(text) if name.endswith(".json") else yaml.safe_load(text)
    return data, out.getvalue(), path


def asked(answers, **env_kw) -> list[str]:
    """The keys of the questions asked for `answers`, in order."""
    script = Script(answers)
    result = ask(QUESTIONS, script, io.StringIO(), env=env(**env_kw))
    assert script.answers == []
    return result.asked


# -- Accelerate as the oracle -----------------------------------------------------------------------


def accelerate_loads(path: Path) -> dict:
    from accelerate.commands.config.config_args import load_config_from_file

    return plain(load_config_from_file(str(path)).to_dict())


def plain(value):
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value.value if hasattr(value, "value") and isinstance(value, str) else value


def accelerate_questionnaire(answers, monkeypatch, accelerator="cuda") -> dict:
    """Accelerate 1.16's own questionnaire given typed answers (menus take the index, as its menu does)."""
    from accelerate.commands.config import cluster, sagemaker
    from accelerate.commands.config import config as acc_config

    typed = iter(answers)

    def menu(text, options=(), convert_value=None, default=0):
        answer = next(typed)
        index = default if answer == "" else int(answer)
        return convert_value(index) if convert_value is not None else index

    monkeypatch.setattr("builtins.input", lambda prompt="": next(typed))
    for module in (cluster, sagemaker, acc_config):
        monkeypatch.setattr(module, "_ask_options", menu)
    monkeypatch.setattr(cluster, "get_torch_accelerator_backend", lambda: (accelerator, None))
    monkeypatch.setattr(cluster, "is_mps_available", lambda: False)
    for probe in ("is_deepspeed_available", "is_fp8_available", "is_transformer_engine_available",
                  "is_torchao_available", "is_transformers_available"):
        monkeypatch.setattr(cluster, probe, lambda: True)
    for var in ("AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(var, "restored-after-the-test")  # Accelerate writes these into os.environ
    config = acc_config.get_user_input()
    assert next(typed, None) is None, "Accelerate asked fewer questions"
    return plain(config.to_dict())


def with_listed_differences(theirs: dict) -> dict:
    """Accelerate's questionnaire result with each deliberate difference applied (docs/compatibility.md)."""
    d = copy.deepcopy(theirs)
    if d.get("downcast_bf16") == "no":
        d["downcast_bf16"] = False  # a bool, not the text "no"
    if "tpu_env" in d:  # an empty answer is [] (not [""]); items stripped; omitted when nothing was asked
        d["tpu_env"] = [v.strip() for v in d["tpu_env"] if v.strip()]
        if not d.get("tpu_use_cluster"):
            del d["tpu_env"]
    if d.get("tpu_vm"):
        d["tpu_vm"] = [v.strip() for v in d["tpu_vm"] if v.strip()]
    if isinstance(d.get("tpu_use_sudo"), str):
        d["tpu_use_sudo"] = d["tpu_use_sudo"].lower() == "yes"  # a bool, not the typed text
    fsdp = d.get("fsdp_config") or {}
    if fsdp.get("fsdp_version") == 1:  # the strategy under the key the FSDP1 runtime reads
        fsdp["fsdp_sharding_strategy"] = fsdp.pop("fsdp_reshard_after_forward")
    fp8 = d.get("fp8_config") or {}
    for questionnaire_name, runtime_name in (("amax_history_length", "amax_history_len"),
                                             ("amax_compute_algorithm", "amax_compute_algo")):
        if questionnaire_name in fp8:
            fp8[runtime_name] = fp8.pop(questionnaire_name)
    return d


def both(*entries):
    """Our answers and Accelerate's: an entry is the same typed text for both, or (ours, theirs), None = not asked."""
    ours = [e[0] if isinstance(e, tuple) else e for e in entries]
    theirs = [e[1] if isinstance(e, tuple) else e for e in entries]
    return [a for a in ours if a is not None], [a for a in theirs if a is not None]


# -- the scenarios ----------------------------------------------------------------------------------
# Menus are answered with the option's index as Accelerate shows it; where our input differs, the
# entry is a pair. Comments name the question.

CPU_ONLY = both("0", "0", "yes", "no", "no", "2")  # this machine, NO, CPU only, dynamo, DeepSpeed, bf16

MULTI_CPU_MPIRUN = both(
    "0", "1", "", "", "yes", "~/hosts",  # multi-CPU, 1 machine, debug, mpirun, hostfile
    "no", "4", "0",  # dynamo, processes, precision
)

MULTI_NODE_GPU = both(
    "0", "4", "2", "1", "10.0.0.1", "29500", "no", "c10d", "yes",  # machines, rank, ip, port, same net, rdzv, debug
    "no", "no", "no", "no",  # dynamo, DeepSpeed, FSDP, Megatron-LM
    "16", "0,1,2,3,4,5,6,7", "yes", "1",  # processes, gpu ids, numa, fp16
)

DEEPSPEED_ZERO3 = both(
    "0", "4", "2", "0", "10.0.0.1", "29500", "", "",  # 2 machines, rank 0, same network, debug
    "no", "yes", "no", "3", "2", "2", "/nvme/params", "",  # dynamo, DS, no json, ZeRO 3, nvme x2, paths
    "4", "yes", "0.5", "yes", "yes", "no",  # grad acc, clipping, value, save 16-bit, zero.Init, MoE
    "", "/job/hostfile", "yes", "worker-1", "no",  # pdsh, hostfile, exclusion filter, inclusion filter
    "16", ("no", None), "2",  # processes, numa (asked here only), bf16
)

DEEPSPEED_JSON = both(
    "0", "0", "no", "no", "yes", "yes", "ds_config.json", "no", "no",  # NO, GPU, dynamo, DS, json, path, init, MoE
    "2", ("", None),  # processes, numa (asked here only); precision is not asked
)

FSDP1 = both(
    "0", "4", "", "", "no", "no", "yes", ("1", "0"),  # 1 machine, debug, dynamo, DS, FSDP, version 1
    "1", "no", "", "no", "BertLayer,BertEmbeddings",  # SHARD_GRAD_OP, offload, transformer wrap, no_split, classes
    "0", "2", "no", "", "no", "yes", "yes",  # BACKWARD_PRE, SHARDED_STATE_DICT, fwd prefetch, orig, ram, sync, ckpt
    "8", ("", None), "2",  # processes, numa, bf16
)

FSDP2_PARALLELISM = both(
    "0", "4", "", "", "no", "no", "yes", "",  # FSDP, version 2
    "", "no", "1", "", "1", "", "no",  # reshard, offload, size wrap, min params, FULL_STATE_DICT, ram, ckpt
    "yes", "2", "2", "2", "2", "1",  # parallelism config, dp replicate, dp shard, tp, cp, alltoall
    "16", ("no", None), "2",
)

MEGATRON = both(
    "0", "4", "", "", "no", "no", "no", "yes",  # Megatron-LM
    "2", "", "2", "4", "", "no", "0.5",  # tp, sequence par, pp, micro-batches, recompute, dist optimizer, clipping
    "8", ("no", None), "2",
)

TPU_COMMANDS = both(
    "0", "10", "no", "8", "",  # TPU, dynamo, cores, main function
    "yes", "my-tpu", "us-central1-a", "yes",  # cluster, name, zone, sudo
    "yes", "no", "pip install -r requirements.txt", "yes", "echo ready", "",  # commands one by one
    "vm-1, vm-2", "",  # VMs, env (empty)
)

FP8_TE = both(
    "0", "0", "no", "no", "no", "0", "no", "3", "1",  # NO on GPU, gpu ids, numa, fp8, te
    "", "1", "2", "1", "512", "1", "yes", "yes", "no", "yes",  # autocast, margin, interval, E4M3, len, algo, override
)

FP8_AO = both("0", "0", "no", "no", "no", "", "", "3", "0", "no", "")  # ao: all-gather off, pad on

DYNAMO_CUSTOM = both(
    "0", "0", "yes", "yes", "5", "yes", "2", "yes", "no", "yes",  # cudagraphs, max-autotune, fullgraph, regional
    "no", "0",  # DeepSpeed, precision
)

SAGEMAKER_PROFILE = both(
    "1", "0", "ml-team", "eu-west-1", "0", "MySageMakerRole",  # profile, region, give a role name
    "yes", "123456789012.dkr.ecr.eu-west-1.amazonaws.com/train:v1",  # image
    "yes", "data/inputs.tsv", "yes", "data/metrics.tsv",  # lower-case: Accelerate lower-cases these
    "1", "yes", "", "yes", ("", "0"), "", "", "",  # data parallel, dynamo, inductor, customize, mode (bug), ...
    "1", "no", "2", "1",  # p3dn, debug, machines, fp16
)

PARITY = {
    "cpu-only": CPU_ONLY,
    "multi-cpu-mpirun": MULTI_CPU_MPIRUN,
    "multi-node-gpu": MULTI_NODE_GPU,
    "deepspeed-zero3-nvme-pdsh": DEEPSPEED_ZERO3,
    "deepspeed-json": DEEPSPEED_JSON,
    "fsdp1": FSDP1,
    "fsdp2-parallelism": FSDP2_PARALLELISM,
    "megatron-lm": MEGATRON,
    "tpu-commands": TPU_COMMANDS,
    "fp8-te": FP8_TE,
    "fp8-ao": FP8_AO,
    "dynamo-custom": DYNAMO_CUSTOM,
    "sagemaker-profile": SAGEMAKER_PROFILE,
}


@pytest.mark.parametrize("name", list(PARITY))
def test_files_match_accelerates_questionnaire_apart_from_listed_differences(name, tmp_path, monkeypatch):
    ours_answers, theirs_answers = PARITY[name]
    ours, _, path = configure(tmp_path, ours_answers)
    theirs = accelerate_questionnaire(theirs_answers, monkeypatch)
    assert accelerate_loads(path) == with_listed_differences(theirs)
    assert load_config_path(path).config.to_dict() == ours  # and our own loader reads it back unchanged


def test_no_distributed_on_cpu_writes_a_single_process_cpu_config(tmp_path):
    data, _, _ = configure(tmp_path, CPU_ONLY[0])
    assert data == {
        "compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": "NO", "downcast_bf16": False,
        "enable_cpu_affinity": False, "machine_rank": 0, "main_training_function": "main", "mixed_precision": "bf16",
        "num_machines": 1, "num_processes": 1, "rdzv_backend": "static", "same_network": True,
        "tpu_use_cluster": False, "tpu_use_sudo": False, "use_cpu": True,
    }


def test_multi_cpu_with_mpirun_stores_the_expanded_hostfile(tmp_path):
    data, _, _ = configure(tmp_path, MULTI_CPU_MPIRUN[0])
    assert data["distributed_type"] == "MULTI_CPU" and data["use_cpu"] is True and data["num_processes"] == 4
    assert data["mpirun_config"] == {"mpirun_hostfile": os.path.expanduser("~/hosts")}


def test_multi_node_gpu_asks_machine_questions_in_accelerates_order(tmp_path):
    assert asked(MULTI_NODE_GPU[0]) == [
        "compute_environment", "machine_type", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
        "same_network", "rdzv_backend", "debug", "use_dynamo", "use_deepspeed", "use_fsdp", "use_megatron_lm",
        "num_processes", "gpu_ids", "enable_cpu_affinity", "mixed_precision",
    ]
    data, _, _ = configure(tmp_path, MULTI_NODE_GPU[0])
    assert {k: data[k] for k in ("machine_rank", "main_process_ip", "main_process_port", "rdzv_backend",
                                 "same_network", "debug", "num_machines", "num_processes", "gpu_ids")} == {
        "machine_rank": 1, "main_process_ip": "10.0.0.1", "main_process_port": 29500, "rdzv_backend": "c10d",
        "same_network": False, "debug": True, "num_machines": 2, "num_processes": 16, "gpu_ids": "0,1,2,3,4,5,6,7",
    }


def test_deepspeed_zero3_with_nvme_offload_and_a_pdsh_hostfile(tmp_path):
    data, _, _ = configure(tmp_path, DEEPSPEED_ZERO3[0])
    assert data["distributed_type"] == "DEEPSPEED" and data["mixed_precision"] == "bf16"
    assert data["deepspeed_config"] == {
        "zero_stage": 3, "offload_optimizer_device": "nvme", "offload_param_device": "nvme",
        "offload_param_nvme_path": "/nvme/params", "offload_optimizer_nvme_path": "/nvme",
        "gradient_accumulation_steps": 4, "gradient_clipping": 0.5, "zero3_save_16bit_model": True,
        "zero3_init_flag": True, "deepspeed_multinode_launcher": "pdsh", "deepspeed_hostfile": "/job/hostfile",
        "deepspeed_exclusion_filter": "worker-1",
    }
    assert "gpu_ids" not in data  # as in Accelerate: DeepSpeed runs use every device


def test_deepspeed_with_a_json_file_stores_no_mixed_precision(tmp_path):
    data, _, path = configure(tmp_path, DEEPSPEED_JSON[0])
    assert "mixed_precision" not in data
    assert data["deepspeed_config"] == {"deepspeed_config_file": "ds_config.json", "zero3_init_flag": False}
    assert load_config_path(path).config.mixed_precision is None


def test_standard_multinode_launcher_needs_no_hostfile():
    keys = asked(["0", "4", "2", "0", "10.0.0.1", "29500", "", "", "no", "yes", "yes", "ds.json", "no", "no",
                  "1", "16", ""])
    assert "deepspeed_multinode_launcher" in keys and "deepspeed_hostfile" not in keys


def test_enable_cpu_affinity_is_asked_for_deepspeed_fsdp_and_megatron_on_gpus(tmp_path):
    numa_on = FSDP2_PARALLELISM[0][:-2] + ["yes", "2"]
    for answers, value in ((DEEPSPEED_ZERO3[0], False), (numa_on, True)):
        data, _, _ = configure(tmp_path, answers)
        assert data["enable_cpu_affinity"] is value
    assert "enable_cpu_affinity" in asked(MEGATRON[0])
    assert "enable_cpu_affinity" not in asked(MULTI_CPU_MPIRUN[0])


def test_deepspeed_yes_is_refused_with_an_install_hint_when_deepspeed_is_missing(tmp_path):
    answers = ["0", "0", "no", "no", "yes", "no", "", "", "0"]  # yes is refused, then no
    data, out, _ = configure(tmp_path, answers, modules=EVERYTHING - {"deepspeed"})
    assert "pip install 'prefect-accelerate[deepspeed]'" in out
    assert data["distributed_type"] == "NO"


def test_fsdp1_stores_the_sharding_strategy_under_the_key_the_runtime_reads(tmp_path):
    data, _, path = configure(tmp_path, FSDP1[0])
    assert data["distributed_type"] == "FSDP" and "gpu_ids" not in data
    assert data["fsdp_config"] == {
        "fsdp_version": 1, "fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_offload_params": False,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "BertLayer,BertEmbeddings", "fsdp_backward_prefetch": "BACKWARD_PRE",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_forward_prefetch": False, "fsdp_use_orig_params": True,
        "fsdp_cpu_ram_efficient_loading": False, "fsdp_sync_module_states": True, "fsdp_activation_checkpointing": True,
    }
    assert load_config_path(path).config.fsdp_config.fsdp_sharding_strategy == "SHARD_GRAD_OP"


def test_fsdp1_with_ram_efficient_loading_forces_synced_module_states(tmp_path):
    answers = ["0", "4", "", "", "no", "no", "yes", "1", "", "no", "2", "", "", "", "", "", "", "4", "", ""]
    keys = asked(answers)
    assert "fsdp_sync_module_states" not in keys and "use_parallelism_config" not in keys
    data, _, _ = configure(tmp_path, answers)
    assert data["fsdp_config"]["fsdp_sync_module_states"] is True
    assert data["fsdp_config"]["fsdp_auto_wrap_policy"] == "NO_WRAP"


def test_fsdp2_with_parallelism_config(tmp_path):
    data, _, _ = configure(tmp_path, FSDP2_PARALLELISM[0])
    assert data["fsdp_config"] == {
        "fsdp_version": 2, "fsdp_reshard_after_forward": True, "fsdp_offload_params": False,
        "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 100000000,
        "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_activation_checkpointing": False,
    }
    assert data["parallelism_config"] == {
        "parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 2,
        "parallelism_config_tp_size": 2, "parallelism_config_cp_size": 2,
        "parallelism_config_cp_comm_strategy": "alltoall",
    }


def test_megatron_lm(tmp_path):
    data, _, _ = configure(tmp_path, MEGATRON[0])
    assert data["distributed_type"] == "MEGATRON_LM" and data["num_processes"] == 8
    assert data["megatron_lm_config"] == {
        "megatron_lm_tp_degree": 2, "megatron_lm_sequence_parallelism": True, "megatron_lm_pp_degree": 2,
        "megatron_lm_num_micro_batches": 4, "megatron_lm_recompute_activations": True,
        "megatron_lm_use_distributed_optimizer": False, "megatron_lm_gradient_clipping": 0.5,
    }


def test_tpu_cluster_with_startup_commands(tmp_path):
    data, out, _ = configure(tmp_path, TPU_COMMANDS[0])
    assert {k: data.get(k) for k in ("distributed_type", "mixed_precision", "num_processes", "tpu_use_cluster",
                                     "tpu_name", "tpu_zone", "tpu_use_sudo", "commands", "tpu_vm", "tpu_env")} == {
        "distributed_type": "XLA", "mixed_precision": "no", "num_processes": 8, "tpu_use_cluster": True,
        "tpu_name": "my-tpu", "tpu_zone": "us-central1-a", "tpu_use_sudo": True,
        "commands": ["pip install -r requirements.txt", "echo ready"], "tpu_vm": ["vm-1", "vm-2"], "tpu_env": [],
    }
    assert "separately" in out


def test_tpu_cluster_with_a_command_file_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    answers = ["0", "10", "no", "", "", "yes", "pod", "zone-a", "", "yes", "yes", "setup.sh", "", "A=1, B=2"]
    data, _, _ = configure(tmp_path, answers)
    assert data["command_file"] == str(tmp_path / "setup.sh") and "commands" not in data
    assert data["tpu_use_sudo"] is False and data["tpu_vm"] == [] and data["tpu_env"] == ["A=1", "B=2"]


def test_required_answers_and_empty_commands_are_asked_again():
    out = io.StringIO()
    answers = ask(QUESTIONS, Script(["0", "10", "no", "", "", "yes", "", "pod", "zone", "", "yes", "no", "", "ls", "",
                                     "", ""]), out, env=env())
    assert out.getvalue().count("An answer is needed here.") == 2
    assert (answers["tpu_name"], answers["commands"], answers["tpu_env"]) == ("pod", ["ls"], [])


def test_tpu_process_question_names_tpu_cores():
    script = Script(["0", "10", "no", "8", "", "no"])
    ask(QUESTIONS, script, io.StringIO(), env=env())
    assert any("How many TPU cores" in p for p in script.prompts)


def test_fp8_with_transformer_engine_stores_the_key_names_the_runtime_reads(tmp_path):
    data, _, path = configure(tmp_path, FP8_TE[0])
    assert data["mixed_precision"] == "fp8"
    assert data["fp8_config"] == {
        "backend": "TE", "use_autocast_during_eval": False, "margin": 1, "interval": 2, "fp8_format": "E4M3",
        "amax_history_len": 512, "amax_compute_algo": "most_recent", "override_linear_precision": [True, False, True],
    }
    fp8 = load_config_path(path).config.fp8_config
    assert (fp8.fp8_amax_history_len, fp8.fp8_amax_compute_algo) == (512, "most_recent")


def test_fp8_with_torchao(tmp_path):
    data, _, _ = configure(tmp_path, FP8_AO[0])
    assert data["fp8_config"] == {"backend": "AO", "enable_fsdp_float8_all_gather": False, "pad_inner_dim": True}


def test_fp8_backend_without_its_package_is_refused_and_asked_again(tmp_path):
    answers = ["0", "0", "no", "no", "no", "", "", "fp8", "te", "ao", "", ""]
    data, out, _ = configure(tmp_path, answers, modules=EVERYTHING - {"transformer_engine"})
    assert "needs the Python package `transformer_engine`" in out
    assert data["fp8_config"]["backend"] == "AO"


def test_fp8_override_defaults_to_three_falses(tmp_path):
    answers = ["0", "0", "no", "no", "no", "", "", "3", "te", "", "", "", "", "", "", ""]
    data, _, _ = configure(tmp_path, answers)
    assert data["fp8_config"]["override_linear_precision"] == [False, False, False]
    assert "fp8_format" in data["fp8_config"] and data["fp8_config"]["amax_history_len"] == 1024


def test_dynamo_with_customised_options(tmp_path):
    data, _, _ = configure(tmp_path, DYNAMO_CUSTOM[0])
    assert data["dynamo_config"] == {
        "dynamo_backend": "CUDAGRAPHS", "dynamo_mode": "max-autotune", "dynamo_use_fullgraph": True,
        "dynamo_use_dynamic": False, "dynamo_use_regional_compilation": True,
    }


def test_dynamo_backend_torchxla_trace_once_works_by_name(tmp_path):
    # Accelerate's menu spells it TORHCHXLA_TRACE_ONCE and crashes converting it
    answers = ["0", "0", "no", "yes", "torchxla_trace_once", "", "no", "", "", ""]
    data, out, _ = configure(tmp_path, answers)
    assert data["dynamo_config"] == {"dynamo_backend": "TORCHXLA_TRACE_ONCE"}
    assert "TF32" in out  # dynamo without mixed precision on a GPU


def test_sagemaker_with_a_profile_keeps_the_case_of_paths_and_image(tmp_path):
    answers = ["1", "0", "", "", "0", "Role", "yes", "123.dkr.ecr.us-east-1.amazonaws.com/Train:V1",
               "yes", "Data/Inputs.TSV", "yes", "Metrics/Defs.TSV", "", "no", "ML.G5.XLARGE", ""]
    data, _, path = configure(tmp_path, answers)
    assert data == {
        "compute_environment": "AMAZON_SAGEMAKER", "distributed_type": "NO", "mixed_precision": "no",
        "use_cpu": False, "debug": False, "ec2_instance_type": "ml.g5.xlarge", "iam_role_name": "Role",
        "image_uri": "123.dkr.ecr.us-east-1.amazonaws.com/Train:V1", "profile": "default", "region": "us-east-1",
        "num_machines": 1, "gpu_ids": "all", "base_job_name": "accelerate-sagemaker-1", "pytorch_version": "1.10.2",
        "transformers_version": "4.17.0", "py_version": "py38", "sagemaker_inputs_file": "Data/Inputs.TSV",
        "sagemaker_metrics_file": "Metrics/Defs.TSV", "enable_cpu_affinity": False,
    }
    assert load_config_path(path).config.to_dict() == data


def test_accelerate_cannot_load_a_sagemaker_config_without_distribution(tmp_path):
    # Not ours to fix, but it limits "files we write load in Accelerate": its process_config adds
    # num_processes to every distributed_type NO file, then rejects that key for SageMaker configs,
    # including the files its own questionnaire writes.
    _, _, path = configure(tmp_path, ["1", "0", "", "", "0", "Role", "", "", "", "", "no", "", ""])
    with pytest.raises(ValueError, match=r"unknown keys \(\['num_processes'\]\)"):
        accelerate_loads(path)


SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
KEY_ID = "AKIAIOSFODNN7EXAMPLE"


def test_sagemaker_credentials_are_asked_but_never_written_nor_shown(tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    secrets = Script([SECRET])
    script, out = Script(["1", "1", KEY_ID, "", "0", "role", "", "", "", "", "no", "", ""]), io.StringIO()
    path = run_questionnaire(tmp_path / "sm.json", input_fn=script, out=out, env=env(), secret_fn=secrets)
    assert secrets.prompts == ["AWS Secret Access Key: "] and script.answers == []
    text = path.read_text()
    for value in (SECRET, KEY_ID):
        assert value not in text and value not in out.getvalue()
    assert "aws_secret_access_key" not in text and "os.environ" not in text
    assert "AWS_SECRET_ACCESS_KEY" not in os.environ  # nor put in this process's environment
    assert json.loads(text)["ec2_instance_type"] == "ml.p3.2xlarge"


def test_answers_never_show_a_secret_in_their_repr():
    answers = ask(QUESTIONS, Script(["1", "1", KEY_ID, SECRET, "", "0", "r", "", "", "", "", "no", "", ""]),
                  io.StringIO(), env=env())
    assert answers["aws_secret_access_key"] == SECRET and SECRET not in repr(answers)


def test_role_menu_is_left_out_when_boto3_is_missing():
    keys = asked(["1", "0", "", "", "r", "", "", "", "", "no", "", ""], modules=EVERYTHING - {"boto3"})
    assert "iam_role_management" not in keys and "iam_role_name" in keys


def stubbed_iam(outcome: str):
    import boto3
    from botocore.stub import ANY, Stubber

    client = boto3.client("iam", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="y")
    stub = Stubber(client)
    if outcome == "created":
        stub.add_response("create_role", {"Role": {"Path": "/", "RoleName": SAGEMAKER_ROLE_NAME, "RoleId": "AROA1234567890EXAMPLE",
                                                   "Arn": f"arn:aws:iam::123456789012:role/{SAGEMAKER_ROLE_NAME}",
                                                   "CreateDate": "2026-01-01T00:00:00Z"}},
                          {"RoleName": SAGEMAKER_ROLE_NAME, "AssumeRolePolicyDocument": ANY})
        stub.add_response("put_role_policy", {}, {"RoleName": SAGEMAKER_ROLE_NAME, "PolicyDocument": ANY,
                                                  "PolicyName": f"{SAGEMAKER_ROLE_NAME}_policy_permission"})
    elif outcome == "exists":
        stub.add_client_error("create_role", service_error_code="EntityAlreadyExists", http_status_code=409)
    else:
        stub.add_client_error("create_role", service_error_code="AccessDenied", service_message="not allowed",
                              http_status_code=403)
    stub.activate()
    return client, stub


CREATE_ROLE = ["1", "0", "", "", "1", "", "", "", "", "no", "", ""]


@pytest.mark.parametrize("outcome, message", [("created", "Created the IAM role"), ("exists", "already exists")])
def test_sagemaker_role_is_created_through_boto3_after_the_last_question(tmp_path, outcome, message):
    client, stub = stubbed_iam(outcome)
    data, out, _ = configure(tmp_path, CREATE_ROLE, iam_client_factory=lambda answers: client)
    stub.assert_no_pending_responses()
    assert data["iam_role_name"] == SAGEMAKER_ROLE_NAME and message in out


def test_a_failed_role_creation_writes_nothing(tmp_path):
    client, _ = stubbed_iam("denied")
    with pytest.raises(ConfigError, match="AccessDenied.*Nothing was written"):
        configure(tmp_path, CREATE_ROLE, iam_client_factory=lambda answers: client)
    assert not (tmp_path / "config.yaml").exists()


def test_iam_client_uses_the_keys_given_without_touching_the_environment(monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    answers = ask(QUESTIONS, Script(["1", "1", KEY_ID, SECRET, "eu-west-1", "1", "", "", "", "", "no", "", ""]),
                  io.StringIO(), env=env())
    credentials = iam_client(answers)._request_signer._credentials
    assert (credentials.access_key, credentials.secret_key) == (KEY_ID, SECRET)
    assert "AWS_ACCESS_KEY_ID" not in os.environ


# -- input handling ---------------------------------------------------------------------------------


def test_invalid_answers_are_explained_and_asked_again(tmp_path):
    answers = [
        "2", "0",  # no option 2 in the first menu
        "multi-gpu",  # a menu answered by name, any case
        "two", "1",  # not a number
        "maybe", "no",  # not yes/no
        "no", "no", "no", "no",
        "1", "2",  # multi-GPU on one machine with one process is refused, not a crash
        "first", "0,1",  # not device ids
        "", "FP16",
    ]
    data, out, _ = configure(tmp_path, answers)
    for why in ("There is no option 2", "The answer 'two' is not a number", "The answer 'maybe' is not yes or no",
                "multi-GPU with one machine needs at least 2 GPUs", "'first' is not `all`"):
        assert why in out
    assert (data["distributed_type"], data["num_processes"], data["gpu_ids"], data["mixed_precision"]) == (
        "MULTI_GPU", 2, "0,1", "fp16")


def test_menus_take_the_stored_value_and_numeric_menus_take_the_number(tmp_path):
    answers = ["this machine", "MULTI_CPU", "3", "2", "10.0.0.2", "70000", "29500", "", "", "", "no", "12", "no"]
    data, out, _ = configure(tmp_path, answers)
    assert (data["machine_rank"], data["num_machines"], data["main_process_port"]) == (2, 3, 29500)
    assert "at most 65535" in out


def test_prompts_say_how_to_answer_a_menu():
    script = Script(["0"])
    with pytest.raises(QuestionnaireInterrupted):
        ask(QUESTIONS, script, io.StringIO(), env=env())
    assert "counting from 0" in script.prompts[-1] and "[0: No distributed training]" in script.prompts[-1]


def test_end_of_input_writes_nothing(tmp_path):
    path = tmp_path / "config.yaml"
    with pytest.raises(QuestionnaireInterrupted, match="interrupted .*nothing was written to") as error:
        run_questionnaire(path, input_fn=Script(["0", "4", "2"]), out=io.StringIO(), env=env())
    assert error.value.exit_code == 2 and "rank of this machine" in error.value.message
    assert not path.exists() and not any(tmp_path.iterdir())


def test_ctrl_c_leaves_an_existing_file_untouched(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("distributed_type: MULTI_CPU\n")

    def interrupt(prompt):
        raise KeyboardInterrupt

    with pytest.raises(QuestionnaireInterrupted, match="Ctrl-C"):
        run_questionnaire(path, input_fn=interrupt, out=io.StringIO(), env=env())
    assert path.read_text() == "distributed_type: MULTI_CPU\n" and not (tmp_path / "config.yaml.bak").exists()


def test_an_existing_file_is_replaced_and_kept_as_backup(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("distributed_type: MULTI_CPU\n")
    _, out, _ = configure(tmp_path, CPU_ONLY[0])
    assert (tmp_path / "config.yaml.bak").read_text() == "distributed_type: MULTI_CPU\n" and "kept in" in out


def test_json_name_gets_json(tmp_path):
    data, _, path = configure(tmp_path, CPU_ONLY[0], name="nested/dir/c.json")
    assert data["use_cpu"] is True and path.read_text().lstrip().startswith("{")
    assert accelerate_loads(path)["mixed_precision"] == "bf16"


def test_default_path_is_under_hf_home(hf_home):
    path = run_questionnaire(input_fn=Script(CPU_ONLY[0]), out=io.StringIO(), env=env())
    assert path == hf_home / "accelerate" / "default_config.yaml" and path.is_file()


def test_a_folder_as_config_file_is_refused_before_any_question(tmp_path):
    script = Script([])
    with pytest.raises(ConfigError, match="is a folder"):
        run_questionnaire(tmp_path, input_fn=script, out=io.StringIO(), env=env())
    assert script.prompts == []


# -- the machine decides what is asked ----------------------------------------------------------------


def test_mps_machines_skip_deepspeed_device_ids_and_numa():
    keys = asked(["0", "0", "no", "no", ""], accelerator="mps", platform="darwin")
    assert keys == ["compute_environment", "machine_type", "use_cpu", "use_dynamo", "mixed_precision"]


def test_neuron_skips_deepspeed_and_fsdp_which_it_does_not_support():
    script = Script(["0", "9", "", "", "no", "2", "", ""])
    answers = ask(QUESTIONS, script, io.StringIO(), env=env())
    assert "use_deepspeed" not in answers.asked and "use_fsdp" not in answers.asked
    assert any("How many NEURON cores" in p for p in script.prompts)


@pytest.mark.parametrize("accelerator, label", [("cuda", "GPU(s)"), ("xpu", "XPU(s)"), ("npu", "NPU(s)"), (None, "GPU(s)")])
def test_device_label_comes_from_the_accelerator(accelerator, label):
    script = Script(["0", "0", "no", "no", "no", "", "", ""])
    ask(QUESTIONS, script, io.StringIO(), env=env(accelerator))
    assert any(f"What {label} (by id)" in p for p in script.prompts)


# -- end to end through the CLI -----------------------------------------------------------------------

FAKE_PACKAGES = ("transformer_engine",)


def run_cli(tmp_path, answers, config_name="cli.yaml"):
    fakes = tmp_path / "fake-packages"
    for name in FAKE_PACKAGES:  # importable (find_spec) so the TE backend can be chosen on this CPU host
        (fakes / name).mkdir(parents=True, exist_ok=True)
        (fakes / name / "__init__.py").write_text("")
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fakes), str(REPO), os.environ.get("PYTHONPATH", "")]))
    path = tmp_path / config_name
    result = subprocess.run(
        [sys.executable, "-m", "prefect_accelerate.cli.main", "config", "--config_file", str(path)],
        input="".join(a + "\n" for a in answers), capture_output=True, text=True, env=environ, cwd=tmp_path, timeout=120,
    )
    return result, path


CLI_CASES = {
    "cpu-only": (CPU_ONLY[0], {"distributed_type": "NO", "use_cpu": True}),
    "multi-node-gpu": (MULTI_NODE_GPU[0], {"distributed_type": "MULTI_GPU", "rdzv_backend": "c10d", "machine_rank": 1}),
    # CPU only: no device question, so this run does not import torch to name the devices
    "fp8-te": (["0", "0", "yes", "no", "no", "3", "1", *FP8_TE[0][9:]], {"mixed_precision": "fp8", "use_cpu": True}),
    "sagemaker-credentials": (["1", "1", KEY_ID, SECRET, "", "0", "role", "", "", "", "1", "no", "", "", "", ""],
                              {"compute_environment": "AMAZON_SAGEMAKER", "distributed_type": "DATA_PARALLEL"}),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_reads_answers_from_stdin_and_writes_the_file(tmp_path, case):
    answers, expected = CLI_CASES[case]
    result, path = run_cli(tmp_path, answers)
    assert result.returncode == 0, result.stderr
    assert f"accelerate configuration saved at {path}" in result.stdout
    data = yaml.safe_load(path.read_text())
    assert {k: data[k] for k in expected} == expected
    assert load_config_path(path).config.to_dict() == data
    assert accelerate_loads(path)["distributed_type"] == expected.get("distributed_type", data["distributed_type"])
    for secret in (SECRET, KEY_ID):
        assert secret not in result.stdout + result.stderr + path.read_text()


def test_cli_end_of_input_exits_2_and_writes_nothing(tmp_path):
    result, path = run_cli(tmp_path, ["0", "4"])
    assert result.returncode == 2 and not path.exists()
    assert "interrupted" in result.stderr and "nothing was written" in result.stderr and "Traceback" not in result.stderr


def test_an_answer_that_is_no_address_is_refused_and_nothing_is_written(tmp_path):
    """The questionnaire writes through the config model, so it holds answers to the same rules as a file read."""
    answers = list(MULTI_NODE_GPU[0])
    answers[answers.index("10.0.0.1")] = "'; rm -rf /"
    with pytest.raises(ConfigError, match="main_process_ip.*host name"):
        configure(tmp_path, answers)
    assert not (tmp_path / "config.yaml").exists()
