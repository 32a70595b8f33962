"""Every `accelerate launch` flag, as data (reference §2.5, Accelerate 1.16.0).

The CLI parser, the options merge and the plan builders all read this one table. Names, defaults,
types and choices are Accelerate's; the help texts are ours. Our own flags (tracking, deadline,
dry run) are at the end, in the group "prefect-accelerate".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefect_accelerate.config.enums import DYNAMO_BACKEND_CHOICES, TORCH_DYNAMO_MODES

_TRUE = {"y", "yes", "t", "true", "on", "1"}
_FALSE = {"n", "no", "f", "false", "off", "0"}


def str_to_bool(value: str) -> int:
    """Accelerate's parser for yes/no flag values: 1 or 0 (it returns ints, and they are exported so)."""
    word = str(value).strip().lower()
    if word in _TRUE:
        return 1
    if word in _FALSE:
        return 0
    raise ValueError(f"invalid truth value {value!r}; use true or false")


str_to_bool.__name__ = "true/false"


def bool_word(value: str) -> bool:
    """A real boolean from a word. Accelerate uses `type=bool` for some flags, so "False" became True."""
    return bool(str_to_bool(value))


bool_word.__name__ = "true/false"


def override_triplet(value: str) -> tuple[int, ...]:
    parts = value.split(",")
    if len(parts) != 3:
        raise ValueError("expected three comma-separated true/false values (fprop,dgrad,wgrad)")
    return tuple(str_to_bool(part) for part in parts)


override_triplet.__name__ = "fprop,dgrad,wgrad"


@dataclass(frozen=True)
class LaunchFlag:
    """One command-line flag of `launch`: argparse settings plus where it belongs."""

    dest: str
    options: tuple[str, ...]
    group: str
    help: str
    kind: str = "store"  # store | store_true | store_false | store_const | append
    type: Callable[[str], Any] | None = None
    default: Any = None
    choices: tuple[Any, ...] | None = None
    const: Any = None
    metavar: str | None = None
    #: the engine the flag belongs to: a row of launchers/engines ENGINES
    engine: str | None = None


def _flags() -> tuple[LaunchFlag, ...]:
    F = LaunchFlag
    top, hw, res, par, dist, tpu, ds, fsdp, meg, fp8, aws, mpi, pc = (
        "options", "Hardware selection", "Resources", "Training paradigm", "Distributed processes",
        "TPU", "DeepSpeed", "FSDP", "Megatron-LM", "FP8", "AWS (SageMaker)", "MPI", "Parallelism config",
    )
    slurm, k8s = "Slurm", "Kubernetes"
    flags = [
        F("config_file", ("--config_file",), top, "Config file to read defaults from (default: the default config, unless --cpu)."),
        F("quiet", ("-q", "--quiet"), top, "Print only the training output, not the launcher's stack traces.", kind="store_true"),
        F("module", ("-m", "--module"), top, "Treat the script as a Python module name, like `python -m`.", kind="store_true"),
        F("no_python", ("--no_python",), top, "Run the script as an executable, without `python` in front.", kind="store_true"),
        F("debug", ("--debug",), top, "Turn on Accelerate's debug mode (checks distributed operations).", kind="store_true"),
        F("cpu", ("--cpu",), hw, "Train on the CPU even when accelerators are present.", kind="store_true", default=False),
        F("multi_gpu", ("--multi_gpu",), hw, "Distributed training on several devices.", kind="store_true", default=False),
        F("tpu", ("--tpu",), hw, "Train on TPUs.", kind="store_true", default=False, engine="tpu"),
        F("mixed_precision", ("--mixed_precision",), res, "Mixed precision mode.", type=str, choices=("no", "fp16", "bf16", "fp8")),
        F("num_processes", ("--num_processes",), res, "Total number of processes to start (all machines together).", type=int),
        F("num_machines", ("--num_machines",), res, "Number of machines taking part.", type=int),
        F("num_cpu_threads_per_process", ("--num_cpu_threads_per_process",), res, "OMP_NUM_THREADS for each process.", type=int),
        F("enable_cpu_affinity", ("--enable_cpu_affinity",), res, "Pin processes to CPU cores near their GPU (NVIDIA only).", kind="store_true", default=False),
        F("dynamo_backend", ("--dynamo_backend",), res, "torch.compile backend.", type=str, choices=DYNAMO_BACKEND_CHOICES),
        F("dynamo_mode", ("--dynamo_mode",), res, "torch.compile mode.", type=str, default="default", choices=TORCH_DYNAMO_MODES),
        F("dynamo_use_fullgraph", ("--dynamo_use_fullgraph",), res, "Compile the whole model as one graph.", kind="store_true", default=False),
        F("dynamo_use_dynamic", ("--dynamo_use_dynamic",), res, "Use dynamic shapes when compiling.", kind="store_true", default=None),
        F("dynamo_use_regional_compilation", ("--dynamo_use_regional_compilation",), res, "Compile repeated blocks once and reuse them.", kind="store_true", default=False),
        F("use_deepspeed", ("--use_deepspeed",), par, "Use DeepSpeed.", kind="store_true", default=False),
        F("use_fsdp", ("--use_fsdp",), par, "Use Fully Sharded Data Parallel.", kind="store_true", default=False),
        F("use_parallelism_config", ("--use_parallelism_config",), par, "Use the parallelism config (needs FSDP version 2).", kind="store_true", default=False),
        F("use_megatron_lm", ("--use_megatron_lm",), par, "Use Megatron-LM.", kind="store_true", default=False),
        F("gpu_ids", ("--gpu_ids",), dist, "Comma-separated device ids to use on this machine, or `all`."),
        F("same_network", ("--same_network",), dist, "All machines are on one local network (static master address).", kind="store_true", default=False),
        F("machine_rank", ("--machine_rank",), dist, "Rank of this machine.", type=int),
        F("main_process_ip", ("--main_process_ip",), dist, "Address of the machine of rank 0.", type=str),
        F("main_process_port", ("--main_process_port",), dist, "Port of the machine of rank 0 (0 picks a free port).", type=int),
        F("tee", ("-t", "--tee"), dist, "torchrun --tee: copy worker output to the console with rank prefixes.", type=str, default="0"),
        F("log_dir", ("--log_dir",), dist, "torchrun --log_dir: where per-rank logs go.", type=str),
        F("role", ("--role",), dist, "torchrun --role.", type=str, default="default"),
        F("rdzv_backend", ("--rdzv_backend",), dist, "Rendezvous backend: static, c10d, etcd or etcd-v2.", type=str, default="static"),
        F("rdzv_conf", ("--rdzv_conf",), dist, "Extra rendezvous settings, e.g. join_timeout=600,read_timeout=60.", type=str, default=""),
        F("max_restarts", ("--max_restarts",), dist, "How many times torchrun restarts failed workers.", type=int, default=0),
        F("monitor_interval", ("--monitor_interval",), dist, "Seconds between torchrun's checks on its workers.", type=float, default=0.1),
        F("tpu_use_cluster", ("--tpu_cluster",), tpu, "Run on every worker of a TPU pod.", kind="store_true", default=False, engine="tpu"),
        F("tpu_use_cluster", ("--no_tpu_cluster",), tpu, "Run on this TPU host only (used on pod workers).", kind="store_false", engine="tpu"),
        F("tpu_use_sudo", ("--tpu_use_sudo",), tpu, "Run the pod command with sudo.", kind="store_true", default=False, engine="tpu"),
        F("vm", ("--vm",), tpu, "TPU VM name (repeatable).", kind="append", type=str, engine="tpu"),
        F("env", ("--env",), tpu, "KEY=VALUE to set on the pod workers (repeatable).", kind="append", type=str, engine="tpu"),
        F("main_training_function", ("--main_training_function",), tpu, "Function the TPU launcher calls in the script.", type=str, engine="tpu"),
        F("downcast_bf16", ("--downcast_bf16",), tpu, "On TPUs with bf16, keep float32 tensors in float32 (XLA_DOWNCAST_BF16).", kind="store_true", default=False),
        F("deepspeed_config_file", ("--deepspeed_config_file",), ds, "DeepSpeed JSON config file.", type=str, engine="deepspeed"),
        F("zero_stage", ("--zero_stage",), ds, "ZeRO stage (0-3).", type=int, engine="deepspeed"),
        F("offload_optimizer_device", ("--offload_optimizer_device",), ds, "Offload optimizer states to none, cpu or nvme.", type=str, engine="deepspeed"),
        F("offload_param_device", ("--offload_param_device",), ds, "Offload parameters to none, cpu or nvme (ZeRO-3).", type=str, engine="deepspeed"),
        F("offload_optimizer_nvme_path", ("--offload_optimizer_nvme_path",), ds, "NVMe folder for offloaded optimizer states.", type=str, engine="deepspeed"),
        F("offload_param_nvme_path", ("--offload_param_nvme_path",), ds, "NVMe folder for offloaded parameters.", type=str, engine="deepspeed"),
        F("gradient_accumulation_steps", ("--gradient_accumulation_steps",), ds, "Gradient accumulation steps.", type=int, engine="deepspeed"),
        F("gradient_clipping", ("--gradient_clipping",), ds, "Gradient clipping value.", type=float, engine="deepspeed"),
        F("zero3_init_flag", ("--zero3_init_flag",), ds, "Build the model with deepspeed.zero.Init (ZeRO-3).", type=str, engine="deepspeed"),
        F("zero3_save_16bit_model", ("--zero3_save_16bit_model",), ds, "Save 16-bit weights with ZeRO-3.", type=str, engine="deepspeed"),
        F("deepspeed_hostfile", ("--deepspeed_hostfile",), ds, "DeepSpeed hostfile for multi-node runs.", type=str, engine="deepspeed"),
        F("deepspeed_exclusion_filter", ("--deepspeed_exclusion_filter",), ds, "Hosts/slots to leave out (DeepSpeed --exclude).", type=str, engine="deepspeed"),
        F("deepspeed_inclusion_filter", ("--deepspeed_inclusion_filter",), ds, "Hosts/slots to use (DeepSpeed --include).", type=str, engine="deepspeed"),
        F("deepspeed_multinode_launcher", ("--deepspeed_multinode_launcher",), ds, "pdsh, standard, openmpi, mvapich, mpich, nossh or slurm.", type=str, engine="deepspeed"),
        F("deepspeed_moe_layer_cls_names", ("--deepspeed_moe_layer_cls_names",), ds, "Comma-separated MoE layer class names.", type=str, engine="deepspeed"),
        F("fsdp_version", ("--fsdp_version",), fsdp, "FSDP version.", type=str, default="1", choices=("1", "2")),
        F("fsdp_offload_params", ("--fsdp_offload_params",), fsdp, "Offload parameters and gradients to the CPU.", type=str, default="false"),
        F("fsdp_min_num_params", ("--fsdp_min_num_params",), fsdp, "Minimum parameters per wrapped module (size-based wrap).", type=int, default=100_000_000),
        F("fsdp_sharding_strategy", ("--fsdp_sharding_strategy",), fsdp, "FSDP1 sharding strategy.", type=str, default="FULL_SHARD"),
        F("fsdp_reshard_after_forward", ("--fsdp_reshard_after_forward",), fsdp, "FSDP2: free gathered parameters after forward.", type=str, default="true"),
        F("fsdp_auto_wrap_policy", ("--fsdp_auto_wrap_policy",), fsdp, "TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP.", type=str),
        F("fsdp_transformer_layer_cls_to_wrap", ("--fsdp_transformer_layer_cls_to_wrap",), fsdp, "Comma-separated layer classes to wrap.", type=str),
        F("fsdp_backward_prefetch", ("--fsdp_backward_prefetch",), fsdp, "BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH.", type=str),
        F("fsdp_state_dict_type", ("--fsdp_state_dict_type",), fsdp, "FULL_STATE_DICT, LOCAL_STATE_DICT or SHARDED_STATE_DICT.", type=str),
        F("fsdp_forward_prefetch", ("--fsdp_forward_prefetch",), fsdp, "Prefetch the next all-gather during forward (FSDP1).", type=str, default="false"),
        F("fsdp_use_orig_params", ("--fsdp_use_orig_params",), fsdp, "Keep the original parameters (FSDP1).", type=str, default="true"),
        F("fsdp_cpu_ram_efficient_loading", ("--fsdp_cpu_ram_efficient_loading",), fsdp, "Load weights on rank 0 only.", type=str, default="true"),
        F("fsdp_sync_module_states", ("--fsdp_sync_module_states",), fsdp, "Broadcast rank 0's weights to the others (FSDP1).", type=str, default="true"),
        F("fsdp_activation_checkpointing", ("--fsdp_activation_checkpointing",), fsdp, "Activation checkpointing for wrapped layers.", type=str, default="false"),
        F("fsdp_activation_checkpointing_offload", ("--fsdp_activation_checkpointing_offload",), fsdp, "Offload checkpointed activations to the CPU.", type=str, default="false"),
        F("megatron_lm_tp_degree", ("--megatron_lm_tp_degree",), meg, "Tensor parallel degree.", type=int, default=1),
        F("megatron_lm_use_custom_fsdp", ("--megatron_lm_use_custom_fsdp",), meg, "Megatron's own FSDP.", type=bool_word, default=False),
        F("megatron_lm_no_load_optim", ("--megatron_lm_no_load_optim",), meg, "Do not load optimizer states.", type=bool_word, default=False),
        F("megatron_lm_eod_mask_loss", ("--megatron_lm_eod_mask_loss",), meg, "Mask the loss at end-of-document tokens.", type=bool_word, default=False),
        F("megatron_lm_overlap_cpu_optimizer_d2h_h2d", ("--megatron_lm_overlap_cpu_optimizer_d2h_h2d",), meg, "Overlap CPU optimizer copies.", type=bool_word, default=False),
        F("megatron_lm_no_save_optim", ("--megatron_lm_no_save_optim",), meg, "Do not save optimizer states.", type=bool_word, default=False),
        F("megatron_lm_optimizer_cpu_offload", ("--megatron_lm_optimizer_cpu_offload",), meg, "Offload the optimizer to the CPU.", type=bool_word, default=False),
        F("megatron_lm_use_precision_aware_optimizer", ("--megatron_lm_use_precision_aware_optimizer",), meg, "Precision-aware optimizer.", type=bool_word, default=False),
        F("megatron_lm_decoder_last_pipeline_num_layers", ("--megatron_lm_decoder_last_pipeline_num_layers",), meg, "Layers in the last pipeline stage.", type=int),
        F("megatron_lm_pp_degree", ("--megatron_lm_pp_degree",), meg, "Pipeline parallel degree.", type=int, default=1),
        F("megatron_lm_num_micro_batches", ("--megatron_lm_num_micro_batches",), meg, "Micro-batches per pipeline step.", type=int),
        F("megatron_lm_sequence_parallelism", ("--megatron_lm_sequence_parallelism",), meg, "Sequence parallelism (with tp > 1).", type=str),
        F("megatron_lm_recompute_activations", ("--megatron_lm_recompute_activations",), meg, "Selective activation recomputation.", type=str),
        F("megatron_lm_use_distributed_optimizer", ("--megatron_lm_use_distributed_optimizer",), meg, "Shard optimizer states across data-parallel ranks.", type=str),
        F("megatron_lm_gradient_clipping", ("--megatron_lm_gradient_clipping",), meg, "Gradient clipping by global norm.", type=float, default=1.0),
        F("megatron_lm_recompute_granularity", ("--megatron_lm_recompute_granularity",), meg, "full or selective.", type=str),
        F("megatron_lm_recompute_method", ("--megatron_lm_recompute_method",), meg, "uniform or block.", type=str),
        F("megatron_lm_recompute_num_layers", ("--megatron_lm_recompute_num_layers",), meg, "Layers to recompute.", type=int),
        F("megatron_lm_attention_backend", ("--megatron_lm_attention_backend",), meg, "Attention backend.", type=str),
        F("megatron_lm_expert_model_parallel_size", ("--megatron_lm_expert_model_parallel_size",), meg, "Expert model parallel size.", type=int),
        F("megatron_lm_context_parallel_size", ("--megatron_lm_context_parallel_size",), meg, "Context parallel size.", type=int),
        F("megatron_lm_attention_dropout", ("--megatron_lm_attention_dropout",), meg, "Attention dropout.", type=float),
        F("megatron_lm_hidden_dropout", ("--megatron_lm_hidden_dropout",), meg, "Hidden dropout.", type=float),
        F("megatron_lm_attention_softmax_in_fp32", ("--megatron_lm_attention_softmax_in_fp32",), meg, "Softmax in float32.", type=str),
        F("megatron_lm_expert_tensor_parallel_size", ("--megatron_lm_expert_tensor_parallel_size",), meg, "Expert tensor parallel size.", type=int),
        F("megatron_lm_calculate_per_token_loss", ("--megatron_lm_calculate_per_token_loss",), meg, "Per-token loss.", type=str),
        F("megatron_lm_use_rotary_position_embeddings", ("--megatron_lm_use_rotary_position_embeddings",), meg, "Rotary position embeddings.", type=str),
        F("fp8_backend", ("--fp8_backend",), fp8, "FP8 backend: ao (torchao) or te (Transformer Engine).", type=str, choices=("ao", "te")),
        F("fp8_use_autocast_during_eval", ("--fp8_use_autocast_during_eval",), fp8, "Use fp8 autocast in evaluation too.", kind="store_true", default=False),
        F("fp8_margin", ("--fp8_margin",), fp8, "Scaling factor margin.", type=int, default=0),
        F("fp8_interval", ("--fp8_interval",), fp8, "Steps between scaling factor updates.", type=int, default=1),
        F("fp8_format", ("--fp8_format",), fp8, "FP8 format.", type=str, default="HYBRID", choices=("HYBRID", "E4M3", "E5M2")),
        F("fp8_amax_history_len", ("--fp8_amax_history_len",), fp8, "amax history length.", type=int, default=1024),
        F("fp8_amax_compute_algo", ("--fp8_amax_compute_algo",), fp8, "How amax is computed from the history.", type=str, default="most_recent", choices=("max", "most_recent")),
        F("fp8_override_linear_precision", ("--fp8_override_linear_precision",), fp8, "Higher precision for fprop,dgrad,wgrad, e.g. false,false,true.", type=override_triplet, default=(False, False, False)),
        F("fp8_enable_fsdp_float8_all_gather", ("--fp8_enable_fsdp_float8_all_gather",), fp8, "All-gather in float8 under FSDP2 (torchao).", type=str_to_bool, default="true"),
        F("fp8_pad_inner_dim", ("--fp8_pad_inner_dim",), fp8, "Pad the inner dimension to a multiple of 16 (torchao).", type=str_to_bool, default="true"),
        F("aws_access_key_id", ("--aws_access_key_id",), aws, "Accepted for compatibility; prefer a profile or a Prefect block. Never logged.", type=str, engine="sagemaker"),
        F("aws_secret_access_key", ("--aws_secret_access_key",), aws, "Accepted for compatibility; prefer a profile or a Prefect block. Never logged.", type=str, engine="sagemaker"),
        F("mpirun_hostfile", ("--mpirun_hostfile",), mpi, "MPI hostfile: start the processes with mpirun.", type=str),
        F("parallelism_config_dp_replicate_size", ("--parallelism_config_dp_replicate_size",), pc, "Data-parallel replicas.", type=int, default=1),
        F("parallelism_config_dp_shard_size", ("--parallelism_config_dp_shard_size",), pc, "Data-parallel shards.", type=int, default=1),
        F("parallelism_config_tp_size", ("--parallelism_config_tp_size",), pc, "Tensor parallel size.", type=int, default=1),
        F("parallelism_config_cp_size", ("--parallelism_config_cp_size",), pc, "Context parallel size.", type=int, default=1),
        F("parallelism_config_cp_backend", ("--parallelism_config_cp_backend",), pc, "Context parallel backend.", type=str, default="torch", choices=("torch",)),
        F("parallelism_config_cp_comm_strategy", ("--parallelism_config_cp_comm_strategy",), pc, "allgather or alltoall.", type=str, default="allgather"),
        F("parallelism_config_sp_size", ("--parallelism_config_sp_size",), pc, "Sequence parallel size.", type=int, default=1),
        F("parallelism_config_sp_backend", ("--parallelism_config_sp_backend",), pc, "Sequence parallel backend.", type=str, default="deepspeed", choices=("deepspeed",)),
        F("parallelism_config_sp_seq_length", ("--parallelism_config_sp_seq_length",), pc, "Sequence length for sequence parallelism.", type=str),
        F("parallelism_config_sp_seq_length_is_variable", ("--parallelism_config_sp_seq_length_is_variable",), pc, "Sequence length varies between batches.", type=bool_word, default=True),
        F("parallelism_config_sp_attn_implementation", ("--parallelism_config_sp_attn_implementation",), pc, "Attention implementation.", type=str, default="sdpa"),
        # ours (not in Accelerate): where a TPU pod is and how to reach AWS without secrets on the command line
        F("tpu_name", ("--tpu_name",), tpu, "TPU pod name (default: the config's tpu_name, or the TPU block).", type=str, engine="tpu"),
        F("tpu_zone", ("--tpu_zone",), tpu, "TPU pod zone (default: the config's tpu_zone, or the TPU block).", type=str, engine="tpu"),
        F("tpu_project", ("--tpu_project",), tpu, "Google Cloud project of the pod (default: gcloud's).", type=str, engine="tpu"),
        F("tpu_block", ("--tpu_block",), tpu, "Name of a saved TpuPodBlock holding name, zone and project.", type=str, engine="tpu"),
        F("tpu_copy_script", ("--tpu_copy_script",), tpu, "Copy the training script (that one file) to every pod worker first (gcloud scp) and run it there; modules it imports must already be installed on the workers.", kind="store_true", default=False, engine="tpu"),
        # ours: submit the launch to Slurm as one batch job (launchers/engines/slurm)
        F("slurm", ("--slurm",), slurm, "Submit one Slurm batch job that runs this launch on every allocated node.", kind="store_true", default=False),
        F("slurm_partition", ("--slurm_partition",), slurm, "Slurm partition (default: the block's, else Slurm's default).", type=str, engine="slurm"),
        F("slurm_time", ("--slurm_time",), slurm, "Time limit, as sbatch --time (e.g. 04:00:00).", type=str, engine="slurm"),
        F("slurm_account", ("--slurm_account",), slurm, "Slurm account to charge.", type=str, engine="slurm"),
        F("slurm_qos", ("--slurm_qos",), slurm, "Slurm quality of service.", type=str, engine="slurm"),
        F("slurm_gpus_per_node", ("--slurm_gpus_per_node",), slurm, "GPUs to allocate on each node (sbatch --gpus-per-node).", type=int, engine="slurm"),
        F("slurm_sbatch_args", ("--slurm_sbatch_args",), slurm, "More sbatch options as one string; write it with = since it starts with --: --slurm_sbatch_args=\"--exclusive --mem=0\".", type=str, engine="slurm"),
        F("slurm_block", ("--slurm_block",), slurm, "Name of a saved SlurmClusterBlock with the cluster's defaults.", type=str, engine="slurm"),
        F("slurm_pending_timeout", ("--slurm_pending_timeout",), slurm, "Cancel the job and fail (exit 2) if it is still pending after this many seconds.", type=float, engine="slurm"),
        # ours: run the launch as one Kubernetes Indexed Job, one pod per machine (launchers/engines/kubernetes)
        F("kubernetes", ("--kubernetes",), k8s, "Submit one Kubernetes Indexed Job (one pod per machine) plus a headless Service for the rendezvous.", kind="store_true", default=False),
        F("kubernetes_image", ("--kubernetes_image",), k8s, "Container image of every pod; it must hold Python, torch, prefect-accelerate and the training script (default: the block's, else PREFECT_ACCELERATE_KUBERNETES_IMAGE, which a flow-run pod of deployments/kubernetes has).", type=str, engine="kubernetes"),
        F("kubernetes_namespace", ("--kubernetes_namespace",), k8s, "Namespace of the Job and Service (default: the block's, else PREFECT_ACCELERATE_KUBERNETES_NAMESPACE, else `default`).", type=str, engine="kubernetes"),
        F("kubernetes_gpus_per_node", ("--kubernetes_gpus_per_node",), k8s, "GPUs per pod (the nvidia.com/gpu limit); 0 or unset trains on CPU with gloo.", type=int, engine="kubernetes"),
        F("kubernetes_cpu_per_node", ("--kubernetes_cpu_per_node",), k8s, "CPU per pod as Kubernetes writes it (8, 7500m).", type=str, engine="kubernetes"),
        F("kubernetes_memory_per_node", ("--kubernetes_memory_per_node",), k8s, "Memory per pod as Kubernetes writes it (64Gi).", type=str, engine="kubernetes"),
        F("kubernetes_service_account", ("--kubernetes_service_account",), k8s, "Service account the pods run as.", type=str, engine="kubernetes"),
        F("kubernetes_image_pull_secret", ("--kubernetes_image_pull_secret",), k8s, "Name of a Secret to pull the image with.", type=str, engine="kubernetes"),
        F("kubernetes_node_selector", ("--kubernetes_node_selector",), k8s, "KEY=VALUE a node must carry (repeatable).", kind="append", type=str, engine="kubernetes"),
        F("kubernetes_toleration", ("--kubernetes_toleration",), k8s, "A taint the pods tolerate, as kubectl writes taints: KEY=VALUE:EFFECT, KEY:EFFECT or KEY (repeatable).", kind="append", type=str, engine="kubernetes"),
        F("kubernetes_secret_env", ("--kubernetes_secret_env",), k8s, "NAME=SECRET:KEY: the variable NAME read from key KEY of the Kubernetes Secret SECRET (repeatable; values never enter a manifest).", kind="append", type=str, engine="kubernetes"),
        F("kubernetes_working_dir", ("--kubernetes_working_dir",), k8s, "Working directory in the container (default: the image's WORKDIR); the script path is taken from there.", type=str, engine="kubernetes"),
        F("kubernetes_dns_timeout", ("--kubernetes_dns_timeout",), k8s, "Seconds each pod waits for pod 0's DNS name before it fails (default 600).", type=float, engine="kubernetes"),
        F("kubernetes_pending_timeout", ("--kubernetes_pending_timeout",), k8s, "Delete the job and fail (exit 2) if some pods are still not scheduled after this many seconds.", type=float, engine="kubernetes"),
        F("kubernetes_block", ("--kubernetes_block",), k8s, "Name of a saved KubernetesClusterBlock with the cluster's defaults.", type=str, engine="kubernetes"),
        F("aws_credentials_block", ("--aws_credentials_block",), aws, "Name of a saved AWS credentials block for SageMaker.", type=str, engine="sagemaker"),
    ]
    return tuple(flags)


LAUNCH_FLAGS: tuple[LaunchFlag, ...] = _flags()

#: dest -> the flag's default, for every Accelerate launch flag (a dest with two options keeps the first)
LAUNCH_DEFAULTS: dict[str, Any] = {}
for _flag in LAUNCH_FLAGS:
    LAUNCH_DEFAULTS.setdefault(_flag.dest, _flag.default)

#: flags whose values are secrets: redacted everywhere, never put on a command line
SECRET_DESTS: frozenset[str] = frozenset({"aws_access_key_id", "aws_secret_access_key"})

#: config values Accelerate ignores because the CLI default is not None (reference §13.1); we apply them
HONOURED_CONFIG_SCALARS: tuple[str, ...] = ("rdzv_backend", "same_network", "enable_cpu_affinity", "downcast_bf16", "tpu_use_sudo")
