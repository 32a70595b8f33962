"""Accelerate's enum values and constant lists, as data (reference §3.6).

Values are Accelerate's own strings, so files move between the two tools unchanged. Every parser,
model and plan builder reads these tables; there is no second copy.
"""

from __future__ import annotations

from enum import Enum


class _StrEnum(str, Enum):
    """A str mixin enum: members compare equal to their plain string values, as Accelerate's do."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def values(cls) -> list[str]:
        return [member.value for member in cls]

    @classmethod
    def parse(cls, value: str) -> _StrEnum:
        """Look a value up ignoring case; raises ValueError listing the allowed values."""
        for member in cls:
            if member.value.lower() == str(value).lower():
                return member
        raise ValueError(f"{value!r} is not one of {', '.join(cls.values())}")


class ComputeEnvironment(_StrEnum):
    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class DistributedType(_StrEnum):
    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


#: Types the launcher treats as "several devices on this machine" (reference §4.2).
MULTI_DEVICE_TYPES: frozenset[DistributedType] = frozenset(
    {
        DistributedType.MULTI_GPU,
        DistributedType.MULTI_NPU,
        DistributedType.MULTI_MLU,
        DistributedType.MULTI_SDAA,
        DistributedType.MULTI_MUSA,
        DistributedType.MULTI_XPU,
        DistributedType.MULTI_HPU,
        DistributedType.MULTI_NEURON,
    }
)


class SageMakerDistributedType(_StrEnum):
    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"


class PrecisionType(_StrEnum):
    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class DynamoBackend(_StrEnum):
    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


class FP8BackendType(_StrEnum):
    NO = "NO"
    TE = "TE"
    MSAMP = "MSAMP"
    AO = "AO"


#: `--dynamo_backend` choices of `accelerate launch` (lower-case). Accelerate's list carries the typo
#: TORHCHXLA_TRACE_ONCE; we offer the correct spelling instead (docs/compatibility.md).
DYNAMO_BACKEND_CHOICES: tuple[str, ...] = (
    "no",
    "eager",
    "aot_eager",
    "inductor",
    "aot_ts_nvfuser",
    "nvprims_nvfuser",
    "cudagraphs",
    "ofi",
    "fx2trt",
    "onnxrt",
    "tensorrt",
    "aot_torchxla_trace_once",
    "torchxla_trace_once",
    "tvm",
)

TORCH_DYNAMO_MODES: tuple[str, ...] = ("default", "reduce-overhead", "max-autotune")

FSDP_SHARDING_STRATEGY: tuple[str, ...] = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
FSDP_AUTO_WRAP_POLICY: tuple[str, ...] = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
FSDP_BACKWARD_PREFETCH: tuple[str, ...] = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
FSDP_STATE_DICT_TYPE: tuple[str, ...] = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")
FSDP2_STATE_DICT_TYPE: tuple[str, ...] = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")

#: FSDP1 sharding strategy -> FSDP2 `reshard_after_forward` (reference §9).
FSDP1_TO_FSDP2_RESHARD: dict[str, bool] = {
    "FULL_SHARD": True,
    "SHARD_GRAD_OP": False,
    "HYBRID_SHARD": True,
    "HYBRID_SHARD_ZERO2": False,
    "NO_SHARD": False,
}

#: Index 1 (`standard`) means "start torchrun on every node" instead of DeepSpeed's runner.
DEEPSPEED_MULTINODE_LAUNCHERS: tuple[str, ...] = ("pdsh", "standard", "openmpi", "mvapich", "mpich", "nossh", "slurm")
OFFLOAD_DEVICES: tuple[str, ...] = ("none", "cpu", "nvme")
RDZV_BACKENDS: tuple[str, ...] = ("static", "c10d", "etcd", "etcd-v2")

FP8_FORMATS: tuple[str, ...] = ("HYBRID", "E4M3", "E5M2")
FP8_AMAX_COMPUTE_ALGOS: tuple[str, ...] = ("max", "most_recent")
FP8_OPT_LEVELS: tuple[str, ...] = ("O1", "O2")
CP_COMM_STRATEGIES: tuple[str, ...] = ("allgather", "alltoall")

SAGEMAKER_PARALLEL_EC2_INSTANCES: tuple[str, ...] = ("ml.p3.16xlarge", "ml.p3dn.24xlarge", "ml.p4dn.24xlarge")
SAGEMAKER_PYTORCH_VERSION = "1.10.2"
SAGEMAKER_TRANSFORMERS_VERSION = "4.17.0"
SAGEMAKER_PYTHON_VERSION = "py38"
SAGEMAKER_BASE_JOB_NAME = "accelerate-sagemaker-1"

WEIGHTS_NAME = "pytorch_model.bin"
SAFE_WEIGHTS_NAME = "model.safetensors"
