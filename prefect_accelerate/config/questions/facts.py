"""Facts the cluster questions' conditions and checks read: what the answers so far mean.

The machine type picked first, the distributed type the config ends with (DeepSpeed, FSDP and
Megatron-LM replace it), whether the run is on CPU or MPS, and how the devices are called. Kept apart
from the question table so the table reads as a list of questions.
"""

from __future__ import annotations

from prefect_accelerate.config.enums import DistributedType, FP8BackendType
from prefect_accelerate.config.questions.engine import Answers

D = DistributedType

DEVICE_TYPES = (D.MULTI_GPU, D.MULTI_XPU, D.MULTI_HPU, D.MULTI_NPU, D.MULTI_MLU, D.MULTI_SDAA, D.MULTI_MUSA, D.MULTI_NEURON)
MULTI_TYPES = (D.MULTI_CPU, *DEVICE_TYPES)
# Neuron supports neither; Accelerate asks and then raises on "yes", so the questions are skipped there.
DEEPSPEED_TYPES = (D.NO, *(t for t in DEVICE_TYPES if t != D.MULTI_NEURON))
FSDP_TYPES = tuple(t for t in DEVICE_TYPES if t != D.MULTI_NEURON)
DEVICE_NAMES = {D.MULTI_GPU: "GPU", D.MULTI_XPU: "XPU", D.MULTI_HPU: "HPU", D.MULTI_NPU: "NPU", D.MULTI_MLU: "MLU",
                 D.MULTI_SDAA: "SDAA", D.MULTI_MUSA: "MUSA"}

# -- facts about the answers so far ------------------------------------------------------------------


def machine(a: Answers) -> DistributedType:
    """The machine type picked in the first menu."""
    return a.get("machine_type", D.NO)


def distributed_type(a: Answers) -> DistributedType:
    """The type the config ends with: DeepSpeed, FSDP or Megatron-LM replace the machine type."""
    for key, kind in (("use_deepspeed", D.DEEPSPEED), ("use_fsdp", D.FSDP), ("use_megatron_lm", D.MEGATRON_LM)):
        if a.get(key):
            return kind
    return machine(a)


def multi_node(a: Answers) -> bool:
    return a.get("num_machines", 1) > 1


def uses_cpu(a: Answers) -> bool:
    return machine(a) == D.MULTI_CPU or (machine(a) == D.NO and bool(a.get("use_cpu")))


def uses_mps(a: Answers) -> bool:
    return not uses_cpu(a) and a.env.has_mps


def deepspeed_inline(a: Answers) -> bool:
    """DeepSpeed configured by these questions rather than by a JSON file."""
    return bool(a.get("use_deepspeed")) and not a.get("deepspeed_use_json")


def fsdp_version(a: Answers) -> int | None:
    return a.get("fsdp_version")


def fp8_backend(a: Answers) -> str | None:
    return a.get("fp8_backend")


def devices_label(a: Answers) -> str:
    """What the devices are called, from the accelerator backend (Accelerate 1.16, reference §12)."""
    kind = a.env.accelerator
    if kind == "cuda":
        return "GPU(s)"
    if kind and kind != "mps":
        return f"{kind.upper()}(s)"
    # no accelerator here (a login node, say): name the devices of the machine type picked
    return f"{DEVICE_NAMES.get(machine(a), 'GPU')}(s)"


def processes_label(a: Answers) -> str:
    kind = machine(a)
    if kind == D.MULTI_CPU:
        return "processes"
    if kind == D.MULTI_NEURON:
        return "NEURON cores"
    if kind == D.XLA:
        return "TPU cores"  # Accelerate prints the enum name: "XLA(s)"
    if kind in DEVICE_NAMES:
        return f"{DEVICE_NAMES[kind]}(s)"
    return devices_label(a)


# -- checks: why an answer is refused (None: accepted) ----------------------------------------------


def refuse_single_gpu(value: int, a: Answers) -> str | None:
    if distributed_type(a) == D.MULTI_GPU and not multi_node(a) and value == 1:
        # Accelerate raises ValueError here and loses every answer
        return (
            "multi-GPU with one machine needs at least 2 GPUs: enter 2 or more, or press Ctrl-C and run "
            "`prefect-accelerate config` again choosing \"No distributed training\" for one GPU."
        )
    return None


def refuse_bad_gpu_ids(value: str, a: Answers) -> str | None:
    text = value.replace(" ", "").rstrip(",")
    if text.lower() == "all" or (text and all(part.isdigit() for part in text.split(","))):
        return None
    return f"{value!r} is not `all` or a comma-separated list of device ids such as 0,1."


def refuse_bad_shard_size(value: int, a: Answers) -> str | None:
    return None if value == -1 or value >= 1 else "Enter 1 or more (or -1 for all the remaining devices)."


def refuse_non_positive(value: float, a: Answers) -> str | None:
    return None if value > 0 else "Enter a number greater than 0."


def refuse_missing_fp8_package(value: str, a: Answers) -> str | None:
    module, extra = {"TE": ("transformer_engine", "transformer_engine"), "AO": ("torchao", "torchao")}[value]
    if not a.env.has_module(module):
        return (
            f"The {value} FP8 backend needs the Python package `{module}`, which is not installed in this "
            f"environment. Pick the other backend, or press Ctrl-C, install it (`pip install {extra}`) and run "
            f"`prefect-accelerate config` again."
        )
    return None


# -- conditions -------------------------------------------------------------------------------------


def all_of(*conditions):
    return lambda a: all(c(a) for c in conditions)


def machine_is(*kinds: DistributedType):
    return lambda a: machine(a) in kinds


def ends_as(*kinds: DistributedType):
    return lambda a: distributed_type(a) in kinds


def is_fsdp1(a: Answers) -> bool:
    return fsdp_version(a) == 1


def is_fsdp2(a: Answers) -> bool:
    return fsdp_version(a) == 2


def is_te(a: Answers) -> bool:
    return fp8_backend(a) == FP8BackendType.TE.value


def is_ao(a: Answers) -> bool:
    return fp8_backend(a) == FP8BackendType.AO.value
