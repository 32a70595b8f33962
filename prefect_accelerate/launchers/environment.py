"""The environment blocks `accelerate launch` gives its children (reference §4.3, §4.4), as pure functions.

Each block takes the merged LaunchOptions (and the host for device-specific names) and returns the
variables it adds, in Accelerate's order. The launch modules compose them.
"""

from __future__ import annotations

import os
from typing import Any

from prefect_accelerate.config.enums import DynamoBackend, PrecisionType
from prefect_accelerate.config.model import as_bool, override_triplet
from prefect_accelerate.envreport.devices import VISIBLE_DEVICES_VARIABLE
from prefect_accelerate.errors import ConfigError, LaunchError
from prefect_accelerate.launchers.host import HostProbe

Env = dict[str, str]

#: Megatron-LM flags exported only when set, in Accelerate's order (after TP_DEGREE and USE_CUSTOM_FSDP)
_MEGATRON_OPTIONAL_HEAD = (
    "no_load_optim", "eod_mask_loss", "no_save_optim", "optimizer_cpu_offload", "use_precision_aware_optimizer",
    "overlap_cpu_optimizer_d2h_h2d", "decoder_last_pipeline_num_layers",
)
_MEGATRON_OPTIONAL_TAIL = (
    "num_micro_batches", "sequence_parallelism", "recompute_activations", "use_distributed_optimizer",
    "recompute_granularity", "recompute_method", "recompute_num_layers", "attention_backend",
    "expert_model_parallel_size", "context_parallel_size", "attention_dropout", "hidden_dropout",
    "attention_softmax_in_fp32", "expert_tensor_parallel_size", "calculate_per_token_loss",
    "use_rotary_position_embeddings",
)
#: FSDP flags exported lower-cased, always (after the optional ones)
_FSDP_ALWAYS_LOWER = (
    ("FSDP_FORWARD_PREFETCH", "fsdp_forward_prefetch"),
    ("FSDP_USE_ORIG_PARAMS", "fsdp_use_orig_params"),
    ("FSDP_CPU_RAM_EFFICIENT_LOADING", "fsdp_cpu_ram_efficient_loading"),
    ("FSDP_SYNC_MODULE_STATES", "fsdp_sync_module_states"),
    ("FSDP_ACTIVATION_CHECKPOINTING", "fsdp_activation_checkpointing"),
    ("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "fsdp_activation_checkpointing_offload"),
)
_FSDP_OPTIONAL = (
    ("FSDP_AUTO_WRAP_POLICY", "fsdp_auto_wrap_policy"),
    ("FSDP_TRANSFORMER_CLS_TO_WRAP", "fsdp_transformer_layer_cls_to_wrap"),
    ("FSDP_BACKWARD_PREFETCH", "fsdp_backward_prefetch"),
    ("FSDP_STATE_DICT_TYPE", "fsdp_state_dict_type"),
)

def _text(value: Any) -> str:
    return str(value)


def debug_env(options) -> Env:
    return {"ACCELERATE_DEBUG_MODE": "true"} if options.debug else {}


def visible_devices_env(options, host: HostProbe) -> Env:
    gpu_ids = options.gpu_ids
    if gpu_ids is None or gpu_ids == "all":
        return {}
    name = VISIBLE_DEVICES_VARIABLE.get(host.accelerator_kind() or "")
    return {name: str(gpu_ids)} if name else {}


def mixed_precision_env(options) -> Env:
    value = str(options.mixed_precision).lower()
    if value not in PrecisionType.values():
        raise ConfigError(f"Unknown mixed_precision mode {options.mixed_precision!r}. Choose one of {', '.join(PrecisionType.values())}.")
    return {"ACCELERATE_MIXED_PRECISION": value}


def fp8_env(options, host: HostProbe) -> Env:
    """ACCELERATE_FP8_* for every fp8 setting that has a value (only when mixed precision is fp8)."""
    if str(options.mixed_precision).lower() != "fp8":
        return {}
    if not host.fp8_available():
        raise LaunchError(
            "mixed_precision is fp8, but neither Transformer Engine (`transformer_engine`) nor torchao is installed "
            "on this machine. Install one of them, or choose bf16/fp16."
        )
    env: Env = {}
    for name in sorted(type(options).model_fields):
        if not name.startswith("fp8_"):
            continue
        value = getattr(options, name)
        if value is None:
            continue
        if name == "fp8_override_linear_precision":
            triplet = value if isinstance(value, tuple) and all(isinstance(v, (int, bool)) for v in value) else override_triplet(value)
            for part, item in zip(("FPROP", "DGRAD", "WGRAD"), triplet, strict=True):
                env[f"ACCELERATE_FP8_OVERRIDE_{part}"] = _text(item)
        else:
            env[f"ACCELERATE_{name.upper()}"] = _text(value.value if hasattr(value, "value") else value)
    return env


def dynamo_env(options) -> Env:
    backend = str(options.dynamo_backend).upper()
    try:
        DynamoBackend.parse(backend)
    except ValueError:
        raise ConfigError(f"Unknown dynamo backend {options.dynamo_backend!r}. Choose one of {', '.join(DynamoBackend.values())}.") from None
    env = {
        "ACCELERATE_DYNAMO_BACKEND": DynamoBackend.parse(backend).value,
        "ACCELERATE_DYNAMO_MODE": _text(options.dynamo_mode),
        "ACCELERATE_DYNAMO_USE_FULLGRAPH": _text(options.dynamo_use_fullgraph),
    }
    if options.dynamo_use_dynamic is not None:
        env["ACCELERATE_DYNAMO_USE_DYNAMIC"] = _text(options.dynamo_use_dynamic)
    env["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"] = _text(options.dynamo_use_regional_compilation)
    return env


def cpu_kmp_env() -> Env:
    """The OpenMP settings Accelerate's simple launcher gives CPU runs (reference §4.3.1, 1.16.0)."""
    return {"KMP_AFFINITY": "granularity=fine,compact,1,0", "KMP_BLOCKTIME": "1"}


def unbuffered_env() -> Env:
    """Ours, not Accelerate's: the children's output unbuffered, so lines reach the console and the run log as
    they are printed (DeepSpeed forwards PYTHON* to its other nodes). A user's own PYTHONUNBUFFERED is kept."""
    return {} if "PYTHONUNBUFFERED" in os.environ else {"PYTHONUNBUFFERED": "1"}


def threads_env(options) -> Env:
    return {"OMP_NUM_THREADS": _text(options.num_cpu_threads_per_process)}


def cpu_affinity_env(options) -> Env:
    return {"ACCELERATE_CPU_AFFINITY": "1"} if as_bool(options.enable_cpu_affinity) else {}


def fsdp_env(options) -> Env:
    if not options.use_fsdp:
        return {}
    if as_bool(options.fsdp_cpu_ram_efficient_loading) and not as_bool(options.fsdp_sync_module_states):
        raise ConfigError(
            "fsdp_cpu_ram_efficient_loading is on but fsdp_sync_module_states is off: with RAM-efficient loading only "
            "rank 0 holds the weights, so they must be synced. Pass --fsdp_sync_module_states true, or turn "
            "RAM-efficient loading off."
        )
    env: Env = {"ACCELERATE_USE_FSDP": "true"}
    env["FSDP_VERSION"] = _text(options.fsdp_version if options.fsdp_version is not None else "1")
    env["FSDP_SHARDING_STRATEGY"] = _text(options.fsdp_sharding_strategy)
    env["FSDP_RESHARD_AFTER_FORWARD"] = _text(options.fsdp_reshard_after_forward).lower()
    env["FSDP_OFFLOAD_PARAMS"] = _text(options.fsdp_offload_params).lower()
    env["FSDP_MIN_NUM_PARAMS"] = _text(options.fsdp_min_num_params)
    for variable, name in _FSDP_OPTIONAL:
        if getattr(options, name) is not None:
            env[variable] = _text(getattr(options, name))
    for variable, name in _FSDP_ALWAYS_LOWER:
        env[variable] = _text(getattr(options, name)).lower()
    if options.fsdp_ignored_modules is not None:
        env["FSDP_IGNORED_MODULES"] = _text(options.fsdp_ignored_modules)
    return env


def megatron_env(options) -> Env:
    if not options.use_megatron_lm:
        return {}
    env: Env = {"ACCELERATE_USE_MEGATRON_LM": "true"}
    env["MEGATRON_LM_TP_DEGREE"] = _text(options.megatron_lm_tp_degree)
    env["MEGATRON_LM_USE_CUSTOM_FSDP"] = _text(options.megatron_lm_use_custom_fsdp)
    for key in _MEGATRON_OPTIONAL_HEAD:
        value = getattr(options, f"megatron_lm_{key}")
        if value is not None:
            env[f"MEGATRON_LM_{key.upper()}"] = _text(value)
    env["MEGATRON_LM_PP_DEGREE"] = _text(options.megatron_lm_pp_degree)
    env["MEGATRON_LM_GRADIENT_CLIPPING"] = _text(options.megatron_lm_gradient_clipping)
    for key in _MEGATRON_OPTIONAL_TAIL:
        value = getattr(options, f"megatron_lm_{key}")
        if value is not None:
            env[f"MEGATRON_LM_{key.upper()}"] = _text(value)
    return env


def parallelism_env(options) -> Env:
    if not options.use_parallelism_config:
        return {}
    prefix = "PARALLELISM_CONFIG_"
    env: Env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true"}
    for key in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "cp_backend", "sp_size", "sp_backend"):
        env[prefix + key.upper()] = _text(getattr(options, f"parallelism_config_{key}"))
    if int(options.parallelism_config_cp_size) > 1:
        env[prefix + "CP_COMM_STRATEGY"] = _text(options.parallelism_config_cp_comm_strategy)
    if int(options.parallelism_config_sp_size) > 1:
        for key in ("sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation"):
            env[prefix + key.upper()] = _text(getattr(options, f"parallelism_config_{key}"))
    return env


def _driver_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def nccl_guard_env(host: HostProbe, inherited: dict[str, str]) -> tuple[Env, str | None]:
    """RTX 40xx cards on old drivers cannot do P2P/IB; disable both unless the user already decided.

    Returns the variables to add and a warning (or None). Any probing problem counts as supported.
    """
    try:
        gpus = host.nvidia_gpus()
    except Exception:
        return {}, None
    if len(gpus) <= 1 or not any("RTX 40" in name for name, _ in gpus):
        return {}, None
    if _driver_tuple(gpus[0][1]) >= (550, 40, 7):
        return {}, None
    env = {name: "1" for name in ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE") if name not in inherited}
    if not env:
        return {}, None
    return env, (
        "Using RTX 4000 series which doesn't support faster communication speedups. Ensuring P2P and IB "
        "communications are disabled."
    )
