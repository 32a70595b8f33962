"""The typed Accelerate config file: `ClusterConfig`, `SageMakerConfig` and their nested sections.

Field names, defaults and enum strings mirror Accelerate's dataclasses (reference §3.4-3.6), so a file
moves between the two tools unchanged. Differences from Accelerate are deliberate and listed in
docs/compatibility.md: unknown keys are rejected (nested ones too), values are type-checked, and a
few contradictory combinations are refused before anything runs.

Nested sections remember how each key was spelled (`sharding_strategy` or `fsdp_sharding_strategy`,
`amax_history_length` or `amax_history_len`) so that writing a file back changes nothing but what a
migration changed.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    field_serializer,
    field_validator,
    model_serializer,
    model_validator,
)

from prefect_accelerate.config.enums import (
    CP_COMM_STRATEGIES,
    DEEPSPEED_MULTINODE_LAUNCHERS,
    FP8_AMAX_COMPUTE_ALGOS,
    FP8_FORMATS,
    FP8_OPT_LEVELS,
    FSDP_AUTO_WRAP_POLICY,
    FSDP_BACKWARD_PREFETCH,
    FSDP_SHARDING_STRATEGY,
    FSDP_STATE_DICT_TYPE,
    OFFLOAD_DEVICES,
    RDZV_BACKENDS,
    SAGEMAKER_BASE_JOB_NAME,
    SAGEMAKER_PYTHON_VERSION,
    SAGEMAKER_PYTORCH_VERSION,
    SAGEMAKER_TRANSFORMERS_VERSION,
    TORCH_DYNAMO_MODES,
    ComputeEnvironment,
    DistributedType,
    DynamoBackend,
    FP8BackendType,
    PrecisionType,
    SageMakerDistributedType,
)
from prefect_accelerate.secrets import redact_mapping

# ---------------------------------------------------------------------------------------------------
# Value types

_TRUE_WORDS = {"true", "yes", "on", "1"}
_FALSE_WORDS = {"false", "no", "off", "0"}


def as_bool(value: Any) -> bool:
    """Read a config flag the way a user means it: `"no"` and `"false"` are False (Python says True)."""
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS or word == "":
            return False
        raise ValueError(f"{value!r} is not a yes/no value")
    return bool(value)


def _check_flag(value: bool | str) -> bool | str:
    if isinstance(value, str) and value.strip().lower() not in _TRUE_WORDS | _FALSE_WORDS:
        raise ValueError("expected true or false (the words yes/no are accepted too)")
    return value


def _reject_bool(value: Any) -> Any:
    # bool is an int subclass; `num_processes: true` is a mistake, not 1
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    if isinstance(value, str):
        raise ValueError("expected a number, got text (remove the quotes)")
    return value


def _whole_number(value: Any) -> Any:
    _reject_bool(value)
    if isinstance(value, float):
        raise ValueError("expected a whole number, got a decimal number")
    return value


def _choice(choices: tuple[str, ...], *, case_insensitive: bool = False, keep_case: bool = False):
    def check(value: Any) -> Any:
        if not isinstance(value, str):
            raise ValueError(f"expected one of {', '.join(choices)}")
        if value in choices:
            return value
        if case_insensitive:
            for choice in choices:
                if choice.lower() == value.lower():
                    return value if keep_case else choice
        raise ValueError(f"expected one of {', '.join(choices)}")

    return AfterValidator(check)


_FLAG_CHECK = AfterValidator(_check_flag)

#: A boolean that also accepts the words a person types (`'no'`, `'yes'`, `"true"`); kept as written in the
#: model, written back to a file as a real boolean (see `file_value`).
Flag = Annotated[bool | str, _FLAG_CHECK]


def _is_flag(field: Any) -> bool:
    if _FLAG_CHECK in field.metadata:
        return True
    return any(_FLAG_CHECK in getattr(arg, "__metadata__", ()) for arg in get_args(field.annotation))


#: flags Accelerate itself writes as the words 'yes'/'no' (its questionnaire does for downcast_bf16): kept
_WORD_FLAGS = frozenset({"downcast_bf16"})


def file_value(name: str, field: Any, value: Any) -> Any:
    """The value as a file should hold it. A flag read as a word becomes true/false: our reader keeps an
    unquoted `no` as the word, and writing it back quoted would make Accelerate read the text 'no', which
    Python counts as true."""
    if isinstance(value, str) and name not in _WORD_FLAGS and _is_flag(field):
        return as_bool(value)
    return value
Int = Annotated[int, BeforeValidator(_whole_number)]
PositiveInt = Annotated[int, BeforeValidator(_whole_number), Field(ge=1)]
NonNegativeInt = Annotated[int, BeforeValidator(_whole_number), Field(ge=0)]
Number = Annotated[float | int, BeforeValidator(_reject_bool)]
Text = Annotated[str, Field(strict=True)]


def _enum_value(enum_cls):
    def parse(value: Any) -> Any:
        if isinstance(value, enum_cls):
            return value
        if isinstance(value, str):
            return enum_cls.parse(value)
        raise ValueError(f"expected one of {', '.join(enum_cls.values())}")

    return BeforeValidator(parse)


Precision = Annotated[PrecisionType, _enum_value(PrecisionType)]

# The limits below are the one rule set for these values: the config model applies them when a file is
# written (config update/default/questionnaire) and read (load, env, launch), and launchers/options.py
# holds flags to the same constants and the same address rule (issue 27).

#: the most processes a config may ask for (all machines together)
MAX_PROCESSES = 1 << 20
#: the most machines a launch may span, and processes it may start on one machine
MAX_MACHINES = 1 << 16
MAX_PROCESSES_PER_MACHINE = 1024

_HOST_LABEL = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")


def address_problem(value: str) -> str | None:
    """Why `value` is not a host name or an IP address (None when it is one).

    A host name is dot-separated labels of letters, digits, hyphens (not at either end) and underscores, at
    most 253 characters; an IPv6 address may be written in brackets. The value is taken as it is, with no
    white space around it: the launch passes it on unchanged, so a `"10.0.0.1\n"` accepted here would reach
    torchrun's --master_addr with its newline.
    """
    import ipaddress

    text = value
    if not text.strip():
        return "it is empty"
    if text != text.strip():
        return "it has white space (a space, tab or line break) before or after it; remove it"
    with_brackets = text.startswith("[") and text.endswith("]")
    try:
        ipaddress.ip_address(text[1:-1] if with_brackets else text)
        return None
    except ValueError:
        pass
    host = text[:-1] if text.endswith(".") else text
    if len(host) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in host.split(".")):  # `$` would allow a final newline
        return None
    return "it must be a host name (such as node-0 or node-0.cluster.local) or an IP address (such as 10.0.0.1)"


def _address(value: str) -> str:
    problem = address_problem(value)
    if problem:
        raise ValueError(problem)
    return value


Address = Annotated[str, Field(strict=True), AfterValidator(_address)]

_GPU_IDS = re.compile(r"^\s*(all|\d+(\s*,\s*\d+)*)\s*,?\s*$", re.IGNORECASE)


def _gpu_ids(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected `all` or a comma-separated list of device indices such as 0,1")
    if isinstance(value, int):  # YAML reads `gpu_ids: 0` as a number
        return str(value)
    if isinstance(value, str) and _GPU_IDS.match(value):
        return value
    raise ValueError("expected `all` or a comma-separated list of device indices such as 0,1")


# ---------------------------------------------------------------------------------------------------
# Nested sections


class Section(BaseModel):
    """A nested dict of the config file (deepspeed_config, fsdp_config, ...).

    ``prefix`` is what `accelerate launch` puts in front of a key that lacks it when it copies the
    section into its arguments (reference §3.5); field names are those launch-side names.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    prefix: ClassVar[str] = ""
    #: other spellings a file may use for a field: {file key without prefix: field name}
    aliases: ClassVar[dict[str, str]] = {}

    _spelling: dict[str, str] = PrivateAttr(default_factory=dict)

    @classmethod
    def canonical(cls, key: str) -> str:
        bare = key[len(cls.prefix):] if cls.prefix and key.startswith(cls.prefix) else key
        if bare in cls.aliases:
            return cls.aliases[bare]
        if cls.prefix and not key.startswith(cls.prefix):
            return cls.prefix + key
        return key

    @model_validator(mode="wrap")
    @classmethod
    def _remember_spelling(cls, data: Any, handler):
        if not isinstance(data, dict):
            return handler(data)
        normalized: dict[str, Any] = {}
        spelling: dict[str, str] = {}
        unknown = [str(k) for k in data if str(k) not in cls.model_fields and cls.canonical(str(k)) not in cls.model_fields]
        if unknown:
            from prefect_accelerate.errors import did_you_mean

            hints = "".join(did_you_mean(k, cls.all_spellings()).replace(" Did", f" For `{k}`, did") for k in unknown)
            raise ValueError(
                f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(f'`{k}`' for k in sorted(unknown))}.{hints} "
                f"Known keys: {', '.join(cls.known_file_keys())}"
            )
        for key, value in data.items():
            name = cls.canonical(str(key)) if str(key) not in cls.model_fields else str(key)
            if name != key:
                spelling[name] = str(key)
            normalized[name] = value  # the later key wins, as in Accelerate
        section = handler(normalized)
        section._spelling = spelling
        return section

    @model_serializer(mode="wrap")
    def _only_set_keys(self, handler):
        # a dump that re-validates to the same section: unset keys stay unset, spellings are kept
        data = handler(self)
        return {self._spelling.get(key, key): value for key, value in data.items() if key in self.model_fields_set}

    def to_dict(self) -> dict[str, Any]:
        """The section as the file holds it: only keys that were set, spelled as they were read."""
        out: dict[str, Any] = {}
        for name in self.model_fields_set:
            value = getattr(self, name)
            if isinstance(value, tuple):
                value = list(value)
            elif hasattr(value, "value") and isinstance(value, str):
                value = value.value
            out[self._spelling.get(name, name)] = file_value(name, type(self).model_fields[name], value)
        return dict(sorted(out.items()))

    def launch_items(self) -> dict[str, Any]:
        """Launch-side names and values of the keys that were set (what launch copies into its args)."""
        return {name: getattr(self, name) for name in sorted(self.model_fields_set)}

    def is_set(self, name: str) -> bool:
        return name in self.model_fields_set

    @classmethod
    def known_file_keys(cls) -> list[str]:
        """The keys to suggest to a user: launch-side names (a prefix may be left out in a file)."""
        return sorted(cls.model_fields)

    @classmethod
    def all_spellings(cls) -> list[str]:
        keys = set(cls.model_fields) | set(cls.aliases)
        if cls.prefix:
            keys |= {name[len(cls.prefix):] for name in cls.model_fields if name.startswith(cls.prefix)}
        return sorted(keys)


class DeepSpeedSection(Section):
    deepspeed_config_file: Text | None = None
    zero_stage: Annotated[int, BeforeValidator(_whole_number), Field(ge=0, le=3)] | None = None
    offload_optimizer_device: Annotated[str, _choice(OFFLOAD_DEVICES, case_insensitive=True, keep_case=True)] | None = None
    offload_param_device: Annotated[str, _choice(OFFLOAD_DEVICES, case_insensitive=True, keep_case=True)] | None = None
    offload_optimizer_nvme_path: Text | None = None
    offload_param_nvme_path: Text | None = None
    gradient_accumulation_steps: PositiveInt | None = None
    gradient_clipping: Number | None = None
    zero3_init_flag: Flag | None = None
    zero3_save_16bit_model: Flag | None = None
    deepspeed_moe_layer_cls_names: Text | None = None
    deepspeed_multinode_launcher: Annotated[str, _choice(DEEPSPEED_MULTINODE_LAUNCHERS)] | None = None
    deepspeed_hostfile: Text | None = None
    deepspeed_exclusion_filter: Text | None = None
    deepspeed_inclusion_filter: Text | None = None


def _fsdp_version(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected 1 or 2")
    if isinstance(value, str) and value.strip() in ("1", "2"):
        return int(value)
    return value


def _reshard(value: Any) -> Any:
    # FSDP2 stores a boolean; FSDP1 questionnaires stored the sharding strategy here (reference §2.1.1)
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        if value.upper() in FSDP_SHARDING_STRATEGY:
            return value
        _check_flag(value)
        return value
    raise ValueError(f"expected true/false or one of {', '.join(FSDP_SHARDING_STRATEGY)}")


class FSDPSection(Section):
    prefix = "fsdp_"

    fsdp_version: Annotated[int, BeforeValidator(_fsdp_version), Field(ge=1, le=2)] | None = None
    fsdp_sharding_strategy: Annotated[str, _choice(FSDP_SHARDING_STRATEGY, case_insensitive=True)] | Annotated[int, Field(ge=1, le=5)] | None = None
    fsdp_reshard_after_forward: Annotated[bool | str, BeforeValidator(_reshard)] | None = None
    fsdp_offload_params: Flag | None = None
    fsdp_auto_wrap_policy: Annotated[str, _choice(FSDP_AUTO_WRAP_POLICY, case_insensitive=True)] | None = None
    fsdp_transformer_layer_cls_to_wrap: Text | list[Text] | None = None
    fsdp_min_num_params: NonNegativeInt | None = None
    fsdp_backward_prefetch: Annotated[str, _choice(FSDP_BACKWARD_PREFETCH, case_insensitive=True)] | None = None
    fsdp_backward_prefetch_policy: Annotated[str, _choice(FSDP_BACKWARD_PREFETCH, case_insensitive=True)] | None = None
    fsdp_state_dict_type: Annotated[str, _choice(FSDP_STATE_DICT_TYPE, case_insensitive=True)] | None = None
    fsdp_forward_prefetch: Flag | None = None
    fsdp_use_orig_params: Flag | None = None
    fsdp_cpu_ram_efficient_loading: Flag | None = None
    fsdp_sync_module_states: Flag | None = None
    fsdp_activation_checkpointing: Flag | None = None
    fsdp_activation_checkpointing_offload: Flag | None = None
    fsdp_ignored_modules: Text | list[Text] | None = None

    @model_validator(mode="after")
    def _ram_efficient_loading_needs_synced_states(self) -> FSDPSection:
        if (
            self.is_set("fsdp_cpu_ram_efficient_loading")
            and self.is_set("fsdp_sync_module_states")
            and as_bool(self.fsdp_cpu_ram_efficient_loading)
            and not as_bool(self.fsdp_sync_module_states)
        ):
            raise ValueError(
                "fsdp_cpu_ram_efficient_loading is true but fsdp_sync_module_states is false: with "
                "RAM-efficient loading only rank 0 holds the weights, so they must be synced to the other "
                "ranks. Set fsdp_sync_module_states to true, or fsdp_cpu_ram_efficient_loading to false"
            )
        return self


def _override_linear_precision(value: Any) -> Any:
    # Accelerate's own sample config stores the tuple as the text "(false, false, false)"
    if isinstance(value, str):
        parts = [p.strip() for p in value.strip().strip("()[]").split(",") if p.strip()]
        if len(parts) != 3:
            raise ValueError("expected three true/false values for fprop, dgrad and wgrad")
        for part in parts:
            _check_flag(part)
        return value
    if isinstance(value, (list, tuple)):
        if len(value) != 3:
            raise ValueError("expected three true/false values for fprop, dgrad and wgrad")
        for item in value:
            if not isinstance(item, (bool, int, str)) or isinstance(item, str) and item.lower() not in _TRUE_WORDS | _FALSE_WORDS:
                raise ValueError("expected three true/false values for fprop, dgrad and wgrad")
        return list(value)
    raise ValueError("expected three true/false values for fprop, dgrad and wgrad")


def override_triplet(value: Any) -> tuple[bool, bool, bool]:
    """(fprop, dgrad, wgrad) from any accepted spelling of `override_linear_precision`."""
    if isinstance(value, str):
        parts = [p.strip() for p in value.strip().strip("()[]").split(",") if p.strip()]
        return tuple(as_bool(p) for p in parts)  # type: ignore[return-value]
    return tuple(as_bool(v) for v in value)  # type: ignore[return-value]


class FP8Section(Section):
    """`fp8_config`. Field names are the ones the runtime reads (ACCELERATE_FP8_<NAME>).

    Accelerate's questionnaire writes `amax_history_length`, `amax_compute_algorithm` and
    `optimization_level`, which its launcher exports under names the runtime never reads
    (reference §4.6, §13.2); here they are aliases of the names that work.
    """

    prefix = "fp8_"
    aliases = {
        "amax_history_length": "fp8_amax_history_len",
        "amax_compute_algorithm": "fp8_amax_compute_algo",
        "optimization_level": "fp8_opt_level",
        "format": "fp8_format",
    }

    fp8_backend: Annotated[FP8BackendType, _enum_value(FP8BackendType)] | None = None
    fp8_use_autocast_during_eval: Flag | None = None
    fp8_margin: Int | None = None
    fp8_interval: PositiveInt | None = None
    fp8_format: Annotated[str, _choice(FP8_FORMATS, case_insensitive=True)] | None = None
    fp8_amax_history_len: PositiveInt | None = None
    fp8_amax_compute_algo: Annotated[str, _choice(FP8_AMAX_COMPUTE_ALGOS, case_insensitive=True)] | None = None
    fp8_override_linear_precision: Annotated[Any, BeforeValidator(_override_linear_precision)] | None = None
    fp8_opt_level: Annotated[str, _choice(FP8_OPT_LEVELS, case_insensitive=True)] | None = None
    fp8_enable_fsdp_float8_all_gather: Flag | None = None
    fp8_pad_inner_dim: Flag | None = None


class DynamoSection(Section):
    prefix = "dynamo_"

    dynamo_backend: Annotated[DynamoBackend, _enum_value(DynamoBackend)] | None = None
    dynamo_mode: Annotated[str, _choice(TORCH_DYNAMO_MODES)] | None = None
    dynamo_use_fullgraph: Flag | None = None
    dynamo_use_dynamic: Flag | None = None
    dynamo_use_regional_compilation: Flag | None = None


class MegatronSection(Section):
    megatron_lm_tp_degree: PositiveInt | None = None
    megatron_lm_pp_degree: PositiveInt | None = None
    megatron_lm_num_micro_batches: PositiveInt | None = None
    megatron_lm_sequence_parallelism: Flag | None = None
    megatron_lm_recompute_activations: Flag | None = None
    megatron_lm_use_distributed_optimizer: Flag | None = None
    megatron_lm_gradient_clipping: Number | None = None
    megatron_lm_use_custom_fsdp: Flag | None = None
    megatron_lm_no_load_optim: Flag | None = None
    megatron_lm_eod_mask_loss: Flag | None = None
    megatron_lm_overlap_cpu_optimizer_d2h_h2d: Flag | None = None
    megatron_lm_no_save_optim: Flag | None = None
    megatron_lm_optimizer_cpu_offload: Flag | None = None
    megatron_lm_use_precision_aware_optimizer: Flag | None = None
    megatron_lm_decoder_last_pipeline_num_layers: Int | None = None
    megatron_lm_recompute_num_layers: Int | None = None
    megatron_lm_expert_model_parallel_size: PositiveInt | None = None
    megatron_lm_context_parallel_size: PositiveInt | None = None
    megatron_lm_expert_tensor_parallel_size: PositiveInt | None = None
    megatron_lm_attention_dropout: Number | None = None
    megatron_lm_hidden_dropout: Number | None = None
    megatron_lm_recompute_granularity: Text | None = None
    megatron_lm_recompute_method: Text | None = None
    megatron_lm_attention_backend: Text | None = None
    megatron_lm_attention_softmax_in_fp32: Flag | None = None
    megatron_lm_calculate_per_token_loss: Flag | None = None
    megatron_lm_use_rotary_position_embeddings: Flag | None = None


class MpirunSection(Section):
    mpirun_hostfile: Text | None = None
    #: oneCCL worker count; Accelerate stopped reading it in 1.13 (kept so old files still load)
    mpirun_ccl: Int | None = None


class ParallelismSection(Section):
    parallelism_config_dp_replicate_size: PositiveInt | None = None
    parallelism_config_dp_shard_size: Annotated[int, BeforeValidator(_whole_number), Field(ge=-1)] | None = None
    parallelism_config_tp_size: PositiveInt | None = None
    parallelism_config_cp_size: PositiveInt | None = None
    parallelism_config_sp_size: PositiveInt | None = None
    parallelism_config_cp_backend: Annotated[str, _choice(("torch",))] | None = None
    parallelism_config_cp_comm_strategy: Annotated[str, _choice(CP_COMM_STRATEGIES)] | None = None
    parallelism_config_sp_backend: Annotated[str, _choice(("deepspeed",))] | None = None
    parallelism_config_sp_seq_length: Text | Int | None = None
    parallelism_config_sp_seq_length_is_variable: Flag | None = None
    parallelism_config_sp_attn_implementation: Text | None = None


#: config field -> section model, in Accelerate's declaration order
SECTION_MODELS: dict[str, type[Section]] = {
    "fp8_config": FP8Section,
    "deepspeed_config": DeepSpeedSection,
    "fsdp_config": FSDPSection,
    "parallelism_config": ParallelismSection,
    "megatron_lm_config": MegatronSection,
    "mpirun_config": MpirunSection,
    "dynamo_config": DynamoSection,
}


def _section(model: type[Section]):
    def parse(value: Any) -> Any:
        if value is None:
            return model()
        if isinstance(value, model):
            return value
        if not isinstance(value, dict):
            raise ValueError("expected a mapping of keys to values")
        return value

    return BeforeValidator(parse)


# ---------------------------------------------------------------------------------------------------
# The two config classes


class BaseConfig(BaseModel):
    """Fields shared by both compute environments (Accelerate's `BaseConfig`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_enum_values=False)

    compute_environment: Annotated[ComputeEnvironment, _enum_value(ComputeEnvironment)] = ComputeEnvironment.LOCAL_MACHINE
    mixed_precision: Precision | None = None
    use_cpu: Flag = False
    debug: Flag = False

    def to_dict(self) -> dict[str, Any]:
        """What the file holds, as Accelerate's `to_dict`: enum values, no None, no empty sections."""
        out: dict[str, Any] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, Section):
                value = value.to_dict() or None
            elif isinstance(value, dict):
                value = value or None
            elif hasattr(value, "value") and isinstance(value, str):
                value = value.value
            if value is not None:
                out[name] = file_value(name, type(self).model_fields[name], value)
        return out

    def field_order(self) -> list[str]:
        """Fields in Accelerate's declaration order (the order `env` prints them)."""
        return list(_DECLARATION_ORDER[type(self).__name__])

    @property
    def is_sagemaker(self) -> bool:
        return self.compute_environment == ComputeEnvironment.AMAZON_SAGEMAKER


class ClusterConfig(BaseConfig):
    """A config for this machine or a cluster of machines (compute_environment LOCAL_MACHINE)."""

    distributed_type: Annotated[DistributedType, _enum_value(DistributedType)]
    #: the upper bound keeps a typo (99999999999) from starting a launcher that grows until memory runs out
    num_processes: Annotated[int, BeforeValidator(_whole_number), Field(ge=-1, le=MAX_PROCESSES)] = -1
    machine_rank: Annotated[int, BeforeValidator(_whole_number), Field(ge=0, lt=MAX_MACHINES)] = 0
    num_machines: Annotated[int, BeforeValidator(_whole_number), Field(ge=1, le=MAX_MACHINES)] = 1
    gpu_ids: Annotated[str, BeforeValidator(_gpu_ids)] | None = None
    main_process_ip: Address | None = None
    main_process_port: Annotated[int, BeforeValidator(_whole_number), Field(ge=0, le=65535)] | None = None
    rdzv_backend: Annotated[str, _choice(RDZV_BACKENDS)] = "static"
    same_network: Flag = False
    main_training_function: Text = "main"
    enable_cpu_affinity: Flag = False
    fp8_config: Annotated[FP8Section, _section(FP8Section)] = Field(default_factory=FP8Section)
    deepspeed_config: Annotated[DeepSpeedSection, _section(DeepSpeedSection)] = Field(default_factory=DeepSpeedSection)
    fsdp_config: Annotated[FSDPSection, _section(FSDPSection)] = Field(default_factory=FSDPSection)
    parallelism_config: Annotated[ParallelismSection, _section(ParallelismSection)] = Field(default_factory=ParallelismSection)
    megatron_lm_config: Annotated[MegatronSection, _section(MegatronSection)] = Field(default_factory=MegatronSection)
    mpirun_config: Annotated[MpirunSection, _section(MpirunSection)] = Field(default_factory=MpirunSection)
    downcast_bf16: Flag = False
    tpu_name: Text | None = None
    tpu_zone: Text | None = None
    tpu_use_cluster: Flag = False
    tpu_use_sudo: Flag = False
    command_file: Text | None = None
    commands: list[Text] | None = None
    tpu_vm: list[Text] | None = None
    tpu_env: list[Text] | None = None
    dynamo_config: Annotated[DynamoSection, _section(DynamoSection)] = Field(default_factory=DynamoSection)

    @field_validator("compute_environment")
    @classmethod
    def _local(cls, value: ComputeEnvironment) -> ComputeEnvironment:
        if value != ComputeEnvironment.LOCAL_MACHINE:
            raise ValueError("a cluster config has compute_environment LOCAL_MACHINE")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ClusterConfig:
        if self.num_processes == 0:
            raise ValueError(
                "num_processes is 0; use 1 for a single process, or the number of processes to start "
                "across all machines"
            )
        if self.machine_rank >= self.num_machines:
            raise ValueError(
                f"machine_rank is {self.machine_rank} but num_machines is {self.num_machines}; ranks go "
                f"from 0 to {self.num_machines - 1}"
            )
        per_machine = self.num_processes // self.num_machines
        if per_machine > MAX_PROCESSES_PER_MACHINE:
            raise ValueError(
                f"num_processes {self.num_processes} over num_machines {self.num_machines} is {per_machine:,} "
                f"processes on one machine; at most {MAX_PROCESSES_PER_MACHINE} are started per machine. Lower "
                "num_processes (it counts the processes of all machines together)"
            )
        if (
            self.distributed_type == DistributedType.DEEPSPEED
            and self.deepspeed_config.deepspeed_config_file
            and self.mixed_precision is not None
        ):
            raise ValueError(
                "mixed_precision is set next to deepspeed_config.deepspeed_config_file: with a DeepSpeed "
                "JSON file the precision belongs in that file (its fp16/bf16 sections), and Accelerate's "
                "runtime would refuse the combination inside your script. Remove mixed_precision"
            )
        return self


class SageMakerConfig(BaseConfig):
    """A config that launches AWS SageMaker training jobs (compute_environment AMAZON_SAGEMAKER)."""

    compute_environment: Annotated[ComputeEnvironment, _enum_value(ComputeEnvironment)] = ComputeEnvironment.AMAZON_SAGEMAKER
    distributed_type: Annotated[SageMakerDistributedType, _enum_value(SageMakerDistributedType)]
    ec2_instance_type: Text
    iam_role_name: Text
    image_uri: Text | None = None
    profile: Text | None = None
    region: Text = "us-east-1"
    num_machines: Annotated[int, BeforeValidator(_whole_number), Field(ge=1, le=MAX_MACHINES)] = 1
    gpu_ids: Annotated[str, BeforeValidator(_gpu_ids)] = "all"
    base_job_name: Text = SAGEMAKER_BASE_JOB_NAME
    pytorch_version: Text = SAGEMAKER_PYTORCH_VERSION
    transformers_version: Text = SAGEMAKER_TRANSFORMERS_VERSION
    py_version: Text = SAGEMAKER_PYTHON_VERSION
    sagemaker_inputs_file: Text | None = None
    sagemaker_metrics_file: Text | None = None
    additional_args: dict[str, Any] | None = None
    dynamo_config: Annotated[DynamoSection, _section(DynamoSection)] = Field(default_factory=DynamoSection)
    enable_cpu_affinity: Flag = False

    @field_serializer("additional_args", when_used="json")
    def _additional_args_without_secrets(self, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # stored by Prefect as flow parameters and results: job environment secrets must not be
        return None if value is None else redact_mapping(value)

    @field_validator("compute_environment")
    @classmethod
    def _sagemaker(cls, value: ComputeEnvironment) -> ComputeEnvironment:
        if value != ComputeEnvironment.AMAZON_SAGEMAKER:
            raise ValueError("a SageMaker config has compute_environment AMAZON_SAGEMAKER")
        return value


AnyConfig = ClusterConfig | SageMakerConfig

_BASE_ORDER = ("compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug")
_DECLARATION_ORDER: dict[str, tuple[str, ...]] = {
    "ClusterConfig": _BASE_ORDER
    + tuple(n for n in ClusterConfig.model_fields if n not in _BASE_ORDER),
    "SageMakerConfig": _BASE_ORDER
    + tuple(n for n in SageMakerConfig.model_fields if n not in _BASE_ORDER),
}

ConfigKind = Literal["cluster", "sagemaker"]


def config_class_for(raw: dict[str, Any]) -> type[ClusterConfig] | type[SageMakerConfig]:
    """Accelerate's rule: no compute_environment, or LOCAL_MACHINE, is a cluster config."""
    env = raw.get("compute_environment")
    if env is None or str(env).upper() == ComputeEnvironment.LOCAL_MACHINE.value:
        return ClusterConfig
    return SageMakerConfig
