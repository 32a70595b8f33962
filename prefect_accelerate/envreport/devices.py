"""Which accelerator this machine has, through torch (imported lazily by each call).

One detection order for the whole package (`config default`, `env`, the launchers): CUDA, XPU, NPU,
MLU, MPS, else CPU. NPU and MLU need their vendor plugins (torch_npu, torch_mlu) to be importable.
"""

from __future__ import annotations

import importlib
import importlib.util
import platform
import subprocess
import sys
from dataclasses import dataclass, field

#: accelerator kind -> distributed_type for more than one device (MPS never runs several)
MULTI_DEVICE_TYPE = {"cuda": "MULTI_GPU", "xpu": "MULTI_XPU", "npu": "MULTI_NPU", "mlu": "MULTI_MLU"}

#: accelerator kind -> variable that selects visible devices (reference §4.3 "Visible devices")
VISIBLE_DEVICES_VARIABLE = {
    "xpu": "ZE_AFFINITY_MASK",
    "mlu": "MLU_VISIBLE_DEVICES",
    "sdaa": "SDAA_VISIBLE_DEVICES",
    "musa": "MUSA_VISIBLE_DEVICES",
    "npu": "ASCEND_RT_VISIBLE_DEVICES",
    "hpu": "HABANA_VISIBLE_MODULES",
    "neuron": "NEURON_RT_VISIBLE_CORES",
    "cuda": "CUDA_VISIBLE_DEVICES",
}

_PLUGINS = {"npu": "torch_npu", "mlu": "torch_mlu"}

#: accelerator kind -> the key of the one device line `accelerate env` prints (reference §2.4, §12)
DEVICE_LINE_KEY = {"cuda": "GPU type", "xpu": "XPU type", "mlu": "MLU type", "npu": "CANN version", "mps": "MPS type"}


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    total_memory: int | None  # bytes


@dataclass(frozen=True)
class AcceleratorInfo:
    """The first accelerator family found, or kind None for a CPU-only machine."""

    kind: str | None
    devices: tuple[Device, ...] = field(default_factory=tuple)

    @property
    def count(self) -> int:
        return len(self.devices)

    @property
    def label(self) -> str:
        return {"cuda": "CUDA", "xpu": "XPU", "npu": "NPU", "mlu": "MLU", "mps": "MPS"}.get(self.kind or "", "N/A")

    def default_distributed_type(self) -> str:
        if self.kind in MULTI_DEVICE_TYPE and self.count > 1:
            return MULTI_DEVICE_TYPE[self.kind]
        return "NO"


def _module(torch, kind: str):
    if kind in _PLUGINS:
        if importlib.util.find_spec(_PLUGINS[kind]) is None:
            return None
        try:
            importlib.import_module(_PLUGINS[kind])
        except Exception:
            return None
    return getattr(torch, kind, None)


def _available(module) -> bool:
    try:
        return bool(module.is_available())
    except Exception:
        return False


def detect_accelerator() -> AcceleratorInfo:
    """Probe torch for CUDA, XPU, NPU, MLU, MPS in that order; CPU-only gives kind None."""
    import torch

    for kind in ("cuda", "xpu", "npu", "mlu"):
        module = _module(torch, kind)
        if module is None or not _available(module):
            continue
        devices = []
        for index in range(int(module.device_count())):
            name, memory = f"{kind}:{index}", None
            try:
                props = module.get_device_properties(index)
                name = str(getattr(props, "name", name))
                memory = int(getattr(props, "total_memory", 0)) or None
            except Exception:
                pass
            devices.append(Device(index, name, memory))
        return AcceleratorInfo(kind, tuple(devices))
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and _available(mps):
        return AcceleratorInfo("mps", (Device(0, "Apple MPS", None),))
    return AcceleratorInfo(None, ())


def device_line(info: AcceleratorInfo) -> tuple[str, str] | None:
    """The device line of `accelerate env` for `info`: ("GPU type", name) and so on; None on CPU.

    CUDA, XPU and MLU show the first device's name (Accelerate asks for the current device, which is
    device 0 unless a script changed it); NPU shows the CANN version torch_npu records; MPS shows the
    CPU brand, as Accelerate 1.16 does.
    """
    key = DEVICE_LINE_KEY.get(info.kind or "")
    if key is None:
        return None
    if info.kind == "npu":
        import torch

        return key, str(getattr(torch.version, "cann", None))
    if info.kind == "mps":
        return key, _apple_chip_name()
    return key, info.devices[0].name if info.devices else "unknown"


def _apple_chip_name() -> str:
    if sys.platform == "darwin":
        try:
            name = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5, check=True
            ).stdout.strip()
            if name:
                return name
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or "Apple Silicon"
