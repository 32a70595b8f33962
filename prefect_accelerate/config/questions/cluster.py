"""The "This machine" branch: every question of Accelerate's `get_cluster_input`, in its order.

Reference §2.1.1 gives the questions and conditions. The table below is that list; `build_cluster`
turns the answers into a config dict (the answers with a `target` go straight in, the rest is derived
here: the distributed type after DeepSpeed/FSDP/Megatron-LM, use_cpu, the FP8 override triple...).
Where this differs from Accelerate on purpose, a comment says why (docs/compatibility.md lists them).
"""

from __future__ import annotations

import os
from typing import Any

from prefect_accelerate.config.enums import (
    CP_COMM_STRATEGIES,
    DEEPSPEED_MULTINODE_LAUNCHERS,
    FP8_AMAX_COMPUTE_ALGOS,
    FP8_FORMATS,
    FSDP2_STATE_DICT_TYPE,
    FSDP_AUTO_WRAP_POLICY,
    FSDP_BACKWARD_PREFETCH,
    FSDP_SHARDING_STRATEGY,
    FSDP_STATE_DICT_TYPE,
    OFFLOAD_DEVICES,
    RDZV_BACKENDS,
    ComputeEnvironment,
    FP8BackendType,
    PrecisionType,
)
from prefect_accelerate.config.questions.common import (
    DYNAMO_QUESTIONS,
    PRECISION_OPTIONS,
    TF32_NOTICE,
    answered,
    integer,
    menu,
    missing_package,
    yes_no,
)
from prefect_accelerate.config.questions.engine import REQUIRED, Answers, Question, options
from prefect_accelerate.config.questions.facts import (
    DEEPSPEED_TYPES,
    DEVICE_TYPES,
    FSDP_TYPES,
    MULTI_TYPES,
    D,
    all_of,
    deepspeed_inline,
    devices_label,
    distributed_type,
    ends_as,
    fsdp_version,
    is_ao,
    is_fsdp1,
    is_fsdp2,
    is_te,
    machine,
    machine_is,
    multi_node,
    processes_label,
    refuse_bad_gpu_ids,
    refuse_bad_shard_size,
    refuse_missing_fp8_package,
    refuse_non_positive,
    refuse_single_gpu,
    uses_cpu,
    uses_mps,
)

#: menu order of Accelerate's "Which type of machine are you using?" (labels as it shows them)
MACHINE_TYPES = options(
    "No distributed training", "multi-CPU", "multi-XPU", "multi-HPU", "multi-GPU", "multi-NPU", "multi-MLU",
    "multi-SDAA", "multi-MUSA", "multi-NEURON", "TPU",
    values=[D.NO, D.MULTI_CPU, D.MULTI_XPU, D.MULTI_HPU, D.MULTI_GPU, D.MULTI_NPU, D.MULTI_MLU, D.MULTI_SDAA,
            D.MULTI_MUSA, D.MULTI_NEURON, D.XLA],
)

# -- the table --------------------------------------------------------------------------------------

MACHINE = (
    Question(key="machine_type", prompt="Which type of machine are you using?", kind="choice", options=MACHINE_TYPES, default=0),
    integer("num_machines", "How many different machines will you use (use more than 1 for multi-node training)?",
            when=machine_is(*MULTI_TYPES), target="num_machines"),
    Question(key="machine_rank", prompt="What is the rank of this machine?", kind="choice",
             options=lambda a: options(*range(a["num_machines"])), default=0, when=multi_node, target="machine_rank"),
    Question(key="main_process_ip", prompt="What is the IP address of the machine that will host the main process?",
             when=multi_node, target="main_process_ip"),
    integer("main_process_port", "What is the port you will use to communicate with the main process?",
            default=REQUIRED, minimum=1, maximum=65535, when=multi_node, target="main_process_port"),
    yes_no("same_network", "Are all the machines on the same local network? Answer `no` if nodes are on the cloud "
           "and/or on different network hosts", default=True, when=multi_node, target="same_network"),
    menu("rdzv_backend", "What rendezvous backend will you use?", RDZV_BACKENDS,
         when=all_of(multi_node, answered("same_network", False)), target="rdzv_backend"),
    yes_no("debug", "Should distributed operations be checked while running for errors? This can avoid timeout "
           "issues but will be slower.", when=machine_is(*MULTI_TYPES), target="debug"),
    yes_no("use_cpu", "Do you want to run your training on CPU only (even if a GPU / Apple Silicon / Ascend NPU "
           "device is available)?", when=machine_is(D.NO)),
    yes_no("use_mpirun", "Do you want accelerate to launch mpirun?", when=machine_is(D.MULTI_CPU)),
    Question(key="mpirun_hostfile", prompt="Please enter the path to the hostfile to use with mpirun",
             default="~/hostfile", convert=os.path.expanduser, when=answered("use_mpirun"),
             target="mpirun_config.mpirun_hostfile"),
)

DEEPSPEED = (
    yes_no("use_deepspeed", "Do you want to use DeepSpeed?", when=all_of(machine_is(*DEEPSPEED_TYPES), lambda a: not uses_mps(a)),
           check=missing_package("deepspeed", "deepspeed", "DeepSpeed")),
    yes_no("deepspeed_use_json", "Do you want to specify a json file to a DeepSpeed config?", when=answered("use_deepspeed")),
    # Accelerate's default here is the text "none", stored as a file name; an answer is required instead
    Question(key="deepspeed_config_file", prompt="Please enter the path to the json DeepSpeed config file",
             when=answered("deepspeed_use_json"), target="deepspeed_config.deepspeed_config_file"),
    menu("zero_stage", "What should be your DeepSpeed's ZeRO optimization stage?", (0, 1, 2, 3), default=2,
         when=deepspeed_inline, target="deepspeed_config.zero_stage"),
    menu("offload_optimizer_device", "Where to offload optimizer states?", OFFLOAD_DEVICES,
         when=lambda a: deepspeed_inline(a) and a["zero_stage"] >= 2, target="deepspeed_config.offload_optimizer_device"),
    menu("offload_param_device", "Where to offload parameters?", OFFLOAD_DEVICES,
         when=lambda a: deepspeed_inline(a) and a["zero_stage"] >= 2, target="deepspeed_config.offload_param_device"),
    Question(key="offload_param_nvme_path", prompt="Nvme Path to offload parameters?", default="/nvme",
             when=answered("offload_param_device", "nvme"), target="deepspeed_config.offload_param_nvme_path"),
    Question(key="offload_optimizer_nvme_path", prompt="Nvme Path to offload optimizer states?", default="/nvme",
             when=answered("offload_optimizer_device", "nvme"), target="deepspeed_config.offload_optimizer_nvme_path"),
    integer("gradient_accumulation_steps", "How many gradient accumulation steps you're passing in your script?",
            when=deepspeed_inline, target="deepspeed_config.gradient_accumulation_steps"),
    yes_no("use_gradient_clipping", "Do you want to use gradient clipping?", when=deepspeed_inline),
    Question(key="gradient_clipping", prompt="What is the gradient clipping value?", kind="float", default=1.0,
             check=refuse_non_positive, when=answered("use_gradient_clipping"), target="deepspeed_config.gradient_clipping"),
    yes_no("zero3_save_16bit_model", "Do you want to save 16-bit model weights when using ZeRO Stage-3?",
           when=lambda a: deepspeed_inline(a) and a["zero_stage"] == 3, target="deepspeed_config.zero3_save_16bit_model"),
    yes_no("zero3_init_flag", "Do you want to enable `deepspeed.zero.Init` when using ZeRO Stage-3 for constructing "
           "massive models?", when=answered("use_deepspeed"), target="deepspeed_config.zero3_init_flag",
           check=missing_package("transformers", "transformers", "`deepspeed.zero.Init` through Accelerate")),
    yes_no("use_moe", "Do you want to enable Mixture-of-Experts training (MoE)?", when=answered("use_deepspeed")),
    Question(key="deepspeed_moe_layer_cls_names",
             prompt="Specify the comma-separated list of transformers MoE layer class names (case-sensitive), e.g. "
                    "`MixtralSparseMoeBlock`, `Qwen2MoeSparseMoeBlock`, `JetMoEAttention,JetMoEBlock`",
             when=answered("use_moe"), target="deepspeed_config.deepspeed_moe_layer_cls_names"),
    menu("deepspeed_multinode_launcher", "Which Type of launcher do you want to use?", DEEPSPEED_MULTINODE_LAUNCHERS,
         when=lambda a: bool(a.get("use_deepspeed")) and multi_node(a), target="deepspeed_config.deepspeed_multinode_launcher"),
    Question(key="deepspeed_hostfile",
             prompt="DeepSpeed configures multi-node compute resources with a hostfile: each row is `hostname "
                    "slots=[num_gpus]`, e.g. `localhost slots=2` (https://www.deepspeed.ai/getting-started/"
                    "#resource-configuration-multi-node). Please specify the location of the hostfile",
             when=lambda a: a.get("deepspeed_multinode_launcher", "standard") != "standard",
             target="deepspeed_config.deepspeed_hostfile"),
    yes_no("use_exclusion_filter", "Do you want to specify exclusion filter string?", when=lambda a: "deepspeed_hostfile" in a),
    Question(key="deepspeed_exclusion_filter", prompt="DeepSpeed exclusion filter string",
             when=answered("use_exclusion_filter"), target="deepspeed_config.deepspeed_exclusion_filter"),
    yes_no("use_inclusion_filter", "Do you want to specify inclusion filter string?", when=lambda a: "deepspeed_hostfile" in a),
    Question(key="deepspeed_inclusion_filter", prompt="DeepSpeed inclusion filter string",
             when=answered("use_inclusion_filter"), target="deepspeed_config.deepspeed_inclusion_filter"),
)

_FSDP = answered("use_fsdp")
FSDP = (
    yes_no("use_fsdp", "Do you want to use FullyShardedDataParallel?",
           when=lambda a: machine(a) in FSDP_TYPES and not a.get("use_deepspeed")),
    menu("fsdp_version", "What should be your FSDP version?", (1, 2), default=1, when=_FSDP, target="fsdp_config.fsdp_version"),
    # Accelerate stores the strategy in fsdp_reshard_after_forward, which the FSDP1 plugin ignores in
    # favour of FSDP_SHARDING_STRATEGY (reference §13.3); it goes under the key the runtime reads.
    menu("fsdp_sharding_strategy", "What should be your sharding strategy?", FSDP_SHARDING_STRATEGY,
         when=is_fsdp1, target="fsdp_config.fsdp_sharding_strategy"),
    yes_no("fsdp_reshard_after_forward", "Do you want to enable resharding after forward?", default=True,
           when=is_fsdp2, target="fsdp_config.fsdp_reshard_after_forward"),
    yes_no("fsdp_offload_params", "Do you want to offload parameters and gradients to CPU?", when=_FSDP,
           target="fsdp_config.fsdp_offload_params"),
    menu("fsdp_auto_wrap_policy", "What should be your auto wrap policy?", FSDP_AUTO_WRAP_POLICY, when=_FSDP,
         target="fsdp_config.fsdp_auto_wrap_policy"),
    yes_no("fsdp_use_no_split_modules", "Do you want to use the model's `_no_split_modules` to wrap. Only applicable "
           "for 🤗 Transformers", when=answered("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP")),
    Question(key="fsdp_transformer_layer_cls_to_wrap",
             prompt="Specify the comma-separated list of transformer layer class names (case-sensitive) to wrap, "
                    "e.g. `BertLayer`, `GPTJBlock`, `T5Block`, `BertLayer,BertEmbeddings,BertSelfOutput`",
             when=answered("fsdp_use_no_split_modules", False), target="fsdp_config.fsdp_transformer_layer_cls_to_wrap"),
    integer("fsdp_min_num_params", "What should be your FSDP's minimum number of parameters for Default Auto Wrapping "
            "Policy?", default=100000000, minimum=0, when=answered("fsdp_auto_wrap_policy", "SIZE_BASED_WRAP"),
            target="fsdp_config.fsdp_min_num_params"),
    menu("fsdp_backward_prefetch", "What should be your FSDP's backward prefetch policy?", FSDP_BACKWARD_PREFETCH,
         when=is_fsdp1, target="fsdp_config.fsdp_backward_prefetch"),
    Question(key="fsdp_state_dict_type", prompt="What should be your FSDP's state dict type?", kind="choice",
             options=lambda a: options(*(FSDP_STATE_DICT_TYPE if fsdp_version(a) == 1 else FSDP2_STATE_DICT_TYPE)),
             default=0, when=_FSDP, target="fsdp_config.fsdp_state_dict_type"),
    yes_no("fsdp_forward_prefetch", "Do you want to enable FSDP's forward prefetch policy?", when=is_fsdp1,
           target="fsdp_config.fsdp_forward_prefetch"),
    yes_no("fsdp_use_orig_params", "Do you want to enable FSDP's `use_orig_params` feature?", default=True,
           when=is_fsdp1, target="fsdp_config.fsdp_use_orig_params"),
    yes_no("fsdp_cpu_ram_efficient_loading", "Do you want to enable CPU RAM efficient model loading? Only applicable "
           "for 🤗 Transformers models.", default=True, when=_FSDP, target="fsdp_config.fsdp_cpu_ram_efficient_loading"),
    yes_no("fsdp_sync_module_states", "Do you want each individually wrapped FSDP unit to broadcast module parameters "
           "from rank 0 at the start?", default=True,
           when=lambda a: is_fsdp1(a) and not a["fsdp_cpu_ram_efficient_loading"], target="fsdp_config.fsdp_sync_module_states"),
    yes_no("fsdp_activation_checkpointing", "Do you want to enable FSDP activation checkpointing?", when=_FSDP,
           target="fsdp_config.fsdp_activation_checkpointing"),
)

_PARALLELISM = answered("use_parallelism_config")
PARALLELISM = (
    yes_no("use_parallelism_config", "Do you want to use the parallelism config?", when=is_fsdp2),
    integer("parallelism_config_dp_replicate_size", "What is the data parallelism replicate size?", when=_PARALLELISM,
            target="parallelism_config.parallelism_config_dp_replicate_size"),
    integer("parallelism_config_dp_shard_size", "What is the FSDP shard size?", minimum=None, check=refuse_bad_shard_size,
            when=_PARALLELISM, target="parallelism_config.parallelism_config_dp_shard_size"),
    integer("parallelism_config_tp_size", "What is the tensor parallelism size?", when=_PARALLELISM,
            target="parallelism_config.parallelism_config_tp_size"),
    integer("parallelism_config_cp_size", "What is the context parallelism size?", when=_PARALLELISM,
            target="parallelism_config.parallelism_config_cp_size"),
    menu("parallelism_config_cp_comm_strategy", "What is the context parallelism communication strategy?",
         CP_COMM_STRATEGIES, when=lambda a: a.get("parallelism_config_cp_size", 1) > 1,
         target="parallelism_config.parallelism_config_cp_comm_strategy"),
)

_MEGATRON = answered("use_megatron_lm")
MEGATRON = (
    yes_no("use_megatron_lm", "Do you want to use Megatron-LM?",
           when=lambda a: machine(a) == D.MULTI_GPU and not a.get("use_deepspeed") and not a.get("use_fsdp")),
    integer("megatron_lm_tp_degree", "What is the Tensor Parallelism degree/size?", when=_MEGATRON,
            target="megatron_lm_config.megatron_lm_tp_degree"),
    yes_no("megatron_lm_sequence_parallelism", "Do you want to enable Sequence Parallelism?", default=True,
           when=lambda a: a.get("megatron_lm_tp_degree", 1) > 1, target="megatron_lm_config.megatron_lm_sequence_parallelism"),
    integer("megatron_lm_pp_degree", "What is the Pipeline Parallelism degree/size?", when=_MEGATRON,
            target="megatron_lm_config.megatron_lm_pp_degree"),
    integer("megatron_lm_num_micro_batches", "What is the number of micro-batches?",
            when=lambda a: a.get("megatron_lm_pp_degree", 1) > 1, target="megatron_lm_config.megatron_lm_num_micro_batches"),
    yes_no("megatron_lm_recompute_activations", "Do you want to enable selective activation recomputation?",
           default=True, when=_MEGATRON, target="megatron_lm_config.megatron_lm_recompute_activations"),
    yes_no("megatron_lm_use_distributed_optimizer", "Do you want to use distributed optimizer which shards optimizer "
           "state and gradients across data parallel ranks?", default=True, when=_MEGATRON,
           target="megatron_lm_config.megatron_lm_use_distributed_optimizer"),
    Question(key="megatron_lm_gradient_clipping", prompt="What is the gradient clipping value based on global L2 Norm "
             "(0 to disable)?", kind="float", default=1.0, minimum=0, when=_MEGATRON,
             target="megatron_lm_config.megatron_lm_gradient_clipping"),
)

RESOURCES = (
    integer("num_processes", lambda a: f"How many {processes_label(a)} should be used for distributed training?",
            when=ends_as(*MULTI_TYPES, D.XLA, D.FSDP, D.DEEPSPEED, D.MEGATRON_LM), check=refuse_single_gpu,
            target="num_processes"),
    Question(key="gpu_ids", prompt=lambda a: f"What {devices_label(a)} (by id) should be used for training on this "
             "machine as a comma-separated list?", default="all", check=refuse_bad_gpu_ids,
             when=lambda a: distributed_type(a) in (*DEVICE_TYPES, D.NO) and not uses_cpu(a) and not uses_mps(a),
             target="gpu_ids"),
    # Accelerate asks only for NO/MULTI_GPU, so DeepSpeed, FSDP and Megatron-LM runs on NVIDIA GPUs
    # could not turn it on, though the launcher honours it for them (reference §10 #15).
    yes_no("enable_cpu_affinity", "Would you like to enable numa efficiency? (Currently only supported on NVIDIA "
           "hardware).", when=lambda a: machine(a) in (D.NO, D.MULTI_GPU) and not uses_cpu(a) and not uses_mps(a),
           target="enable_cpu_affinity"),
)

_CLUSTER = answered("tpu_use_cluster")
TPU = (
    Question(key="main_training_function", prompt="What is the name of the function in your script that should be "
             "launched in all parallel scripts?", default="main", when=machine_is(D.XLA), target="main_training_function"),
    yes_no("tpu_use_cluster", "Are you using a TPU cluster?", when=machine_is(D.XLA), target="tpu_use_cluster"),
    Question(key="tpu_name", prompt="What is the name of your TPU cluster?", when=_CLUSTER, target="tpu_name"),
    Question(key="tpu_zone", prompt="What is the zone of your TPU cluster?", when=_CLUSTER, target="tpu_zone"),
    # Accelerate reads this one without a converter and stores the typed text ("no" is then truthy)
    yes_no("tpu_use_sudo", "To run a python script in a TPU pod, should `sudo` be used?", when=_CLUSTER,
           target="tpu_use_sudo"),
    yes_no("tpu_run_commands", "Do you have code you wish to run on startup in each pod?", when=_CLUSTER),
    yes_no("tpu_use_command_file", "Is this code located in a bash script?", when=answered("tpu_run_commands")),
    Question(key="command_file", prompt="What is the path to your bash script?", convert=os.path.abspath,
             when=answered("tpu_use_command_file"), target="command_file"),
    Question(key="commands", prompt="Please enter a single command to be run", kind="lines",
             more_prompt="Do you wish to add another command?", when=answered("tpu_use_command_file", False),
             intro="Please enter each command you wish to run on startup in each pod separately.", target="commands"),
    Question(key="tpu_vm", prompt="If not using an instance group, what are the names of the Compute VM instances to "
             "be used, separated by a comma", kind="list", default="", when=_CLUSTER, target="tpu_vm"),
    Question(key="tpu_env", prompt="What environment variables do you wish to set in each pod, separated by a comma",
             kind="list", default="", when=_CLUSTER, target="tpu_env"),
)

PRECISION = (
    # A DeepSpeed JSON file carries its own precision; storing one beside it makes the runtime refuse
    # the combination (reference §13.5), so the question is skipped as in Accelerate.
    Question(key="mixed_precision", prompt="Do you wish to use mixed precision?", kind="choice", options=PRECISION_OPTIONS,
             default=0, when=lambda a: machine(a) != D.XLA and not a.get("deepspeed_use_json"), target="mixed_precision"),
    # Accelerate 1.16 has no MS-AMP backend any more (reference §12)
    Question(key="fp8_backend", prompt="Which FP8 backend do you want to use?", kind="choice",
             options=options("ao", "te", values=[FP8BackendType.AO.value, FP8BackendType.TE.value]), default=0,
             check=refuse_missing_fp8_package, when=answered("mixed_precision", PrecisionType.FP8.value), target="fp8_config.backend"),
    yes_no("fp8_use_autocast_during_eval", "Do you want to use FP8 autocast during eval mode? Generally better metrics "
           "are found when this is disabled", when=is_te, target="fp8_config.use_autocast_during_eval"),
    integer("fp8_margin", "What margin should be used for gradient scaling?", default=0, minimum=0, when=is_te,
            target="fp8_config.margin"),
    integer("fp8_interval", "What interval should be used for how often the scaling factor is recomputed?", when=is_te,
            target="fp8_config.interval"),
    menu("fp8_format", "Which weight format should be used?", FP8_FORMATS, when=is_te, target="fp8_config.fp8_format"),
    # Accelerate stores amax_history_length / amax_compute_algorithm, which launch exports under names
    # the runtime never reads (reference §13.2); these are the names it reads.
    integer("fp8_amax_history_len", "What length of history should be used for the amax scaling factor computation?",
            default=1024, when=is_te, target="fp8_config.amax_history_len"),
    menu("fp8_amax_compute_algo", "Which algorithm should be used for the amax scaling factor computation?",
         FP8_AMAX_COMPUTE_ALGOS, when=is_te, target="fp8_config.amax_compute_algo"),
    yes_no("fp8_override_linear_precision", "Do you want to execute `fprop`, `dgrad`, and `wgrad` GEMMS in higher "
           "precision?", when=is_te),
    *(
        yes_no(f"fp8_override_{gemm}", f"Should `{gemm}` be executed in higher precision?",
               when=answered("fp8_override_linear_precision"))
        for gemm in ("fprop", "dgrad", "wgrad")
    ),
    yes_no("fp8_enable_fsdp_float8_all_gather", "Do you want to enable FSDP2 float8 all gather? This is recommended "
           "for better performance if using FSDP2.", default=True, when=is_ao, target="fp8_config.enable_fsdp_float8_all_gather"),
    yes_no("fp8_pad_inner_dim", "Do you want to pad the inner dimension of weight matrices before float8 matmuls? This "
           "is required for _scaled_mm which has strict alignment requirements. Note: padding may cause memory spikes.",
           default=True, when=is_ao, target="fp8_config.pad_inner_dim"),
)

CLUSTER_QUESTIONS: tuple[Question, ...] = (
    *MACHINE, *DYNAMO_QUESTIONS, *DEEPSPEED, *FSDP, *PARALLELISM, *MEGATRON, *RESOURCES, *TPU, *PRECISION,
)


def build_cluster(a: Answers) -> dict[str, Any]:
    """The config dict (Accelerate's file format) for the answers of the cluster branch."""
    kind = distributed_type(a)
    data: dict[str, Any] = {
        "compute_environment": ComputeEnvironment.LOCAL_MACHINE.value,
        "distributed_type": kind.value,
        "use_cpu": uses_cpu(a),
        "debug": False,
        "num_processes": 1,
        "machine_rank": 0,
        "num_machines": 1,
        "rdzv_backend": "static",
        "same_network": True,  # what Accelerate's questionnaire writes (the dataclass default is False)
        "main_training_function": "main",
        "enable_cpu_affinity": False,
        "downcast_bf16": False,  # Accelerate writes the text "no"; its bf16-on-TPU question is unreachable
        "tpu_use_cluster": False,
        "tpu_use_sudo": False,
    }
    if kind == D.XLA:
        data["mixed_precision"] = PrecisionType.NO.value
    data.update(a.to_config_dict())
    fsdp = data.get("fsdp_config")
    if fsdp and fsdp.get("fsdp_version") == 1 and fsdp.get("fsdp_cpu_ram_efficient_loading"):
        fsdp["fsdp_sync_module_states"] = True  # RAM-efficient loading needs rank 0's weights broadcast
    if is_te(a):
        override = a["fp8_override_linear_precision"]
        data["fp8_config"]["override_linear_precision"] = [
            bool(override and a[f"fp8_override_{gemm}"]) for gemm in ("fprop", "dgrad", "wgrad")
        ]
    return data


def cluster_notices(a: Answers) -> list[str]:
    precision = PrecisionType.NO.value if machine(a) == D.XLA else a.get("mixed_precision")
    if a.get("use_dynamo") and precision == PrecisionType.NO.value and not uses_cpu(a):
        return [TF32_NOTICE]
    return []
