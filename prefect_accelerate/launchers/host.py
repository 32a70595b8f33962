"""What a launch plan needs to know about the machine it will run on.

Plans are pure functions of their options and this probe. The real probe asks the machine (lazily,
once per question); tests and parity checks pass a `StaticHost` describing another machine (8 GPUs,
a busy port, Open MPI installed) without touching this one.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
from pathlib import Path

from prefect_accelerate.launchers.ports import rendezvous_port
from dataclasses import dataclass, field


#: vendor plugins and tools whose devices only torch can count; their presence means "ask torch"
_NEEDS_TORCH_PLUGINS = ("torch_npu", "torch_mlu", "torch_sdaa", "torch_musa", "habana_frameworks", "torch_neuronx")
_NEEDS_TORCH_TOOLS = ("xpu-smi", "sycl-ls", "hl-smi", "neuron-ls")


def _visible_count(variable: str, total: int) -> int:
    value = os.environ.get(variable)
    if value is None:
        return total
    ids = [v for v in value.split(",") if v.strip() and v.strip() != "-1"]
    return min(len(ids), total)


def _light_accelerator_probe() -> tuple[str | None, int] | None:
    """Find NVIDIA GPUs (or none) without importing torch, so plans and dry runs stay fast.

    Returns None when only torch can tell (another vendor's plugin or tools are installed).
    """
    import importlib.util
    import platform

    if any(importlib.util.find_spec(name) is not None for name in _NEEDS_TORCH_PLUGINS):
        return None
    if any(shutil.which(tool) for tool in _NEEDS_TORCH_TOOLS):
        return None
    total = 0
    proc_gpus = "/proc/driver/nvidia/gpus"
    if os.path.isdir(proc_gpus):
        total = len(os.listdir(proc_gpus))
    elif shutil.which("nvidia-smi"):
        try:
            listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        total = sum(1 for line in listing.splitlines() if line.startswith("GPU "))
    if total:
        count = _visible_count("CUDA_VISIBLE_DEVICES", total)
        return ("cuda", count) if count else (None, 0)
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return "mps", 1
    return None, 0


class HostProbe:
    """Facts about the launching machine. Subclass or use StaticHost in tests."""

    def accelerator_kind(self) -> str | None:
        """cuda, xpu, npu, mlu, mps, or None for CPU only."""
        return self._accelerator()[0]

    def accelerator_count(self) -> int:
        return self._accelerator()[1]

    @functools.lru_cache(maxsize=1)  # noqa: B019 - one probe per process is the point
    def _accelerator(self) -> tuple[str | None, int]:
        light = _light_accelerator_probe()
        if light is not None:
            return light
        from prefect_accelerate.envreport.devices import detect_accelerator

        info = detect_accelerator()
        return info.kind, info.count

    def bf16_available(self) -> bool:
        """bf16 support: NVIDIA GPUs need compute capability 8.0 (Ampere) or newer; CPUs always have it."""
        if self.accelerator_kind() != "cuda":
            return True
        caps = self.command_output(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]).split()
        try:
            return bool(caps) and all(float(cap) >= 8.0 for cap in caps)
        except ValueError:
            return True  # unknown: let the script decide rather than refuse

    def fp8_available(self) -> bool:
        import importlib.util

        return any(importlib.util.find_spec(name) is not None for name in ("transformer_engine", "torchao"))

    def physical_cores(self) -> int:
        import psutil

        return psutil.cpu_count(logical=False) or os.cpu_count() or 1

    def port_in_use(self, port: int, host: str = "localhost") -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.5)
            return sock.connect_ex((host, port)) == 0

    def free_port(self) -> int:
        return rendezvous_port()

    def which(self, program: str) -> str | None:
        return shutil.which(program)

    def command_output(self, argv: list[str]) -> str:
        """stdout+stderr of a short command, '' when it cannot run."""
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
        except (OSError, subprocess.SubprocessError):
            return ""
        return (done.stdout or "") + (done.stderr or "")

    def nvidia_gpus(self) -> list[tuple[str, str]]:
        """(name, driver version) per GPU from nvidia-smi, without initialising CUDA; [] when unknown."""
        if self.which("nvidia-smi") is None:
            return []
        names = self.command_output(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]).strip().splitlines()
        drivers = self.command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).strip().splitlines()
        return [(name.strip(), (drivers[i] if i < len(drivers) else "").strip()) for i, name in enumerate(names) if name.strip()]

    def python(self) -> str:
        import sys

        return sys.executable



@dataclass
class StaticHost(HostProbe):
    """A described machine, for tests and parity checks: nothing is probed."""

    kind: str | None = None
    count: int = 0
    cores: int = 2
    bf16: bool = True
    fp8: bool = True
    busy_ports: set[int] = field(default_factory=set)
    next_free_port: int = 45678
    programs: dict[str, str] = field(default_factory=dict)  # name -> path
    outputs: dict[str, str] = field(default_factory=dict)  # argv joined by spaces -> output
    gpus: list[tuple[str, str]] = field(default_factory=list)
    python_path: str = "python"

    def accelerator_kind(self) -> str | None:
        return self.kind

    def accelerator_count(self) -> int:
        return self.count

    def bf16_available(self) -> bool:
        return self.bf16

    def fp8_available(self) -> bool:
        return self.fp8

    def physical_cores(self) -> int:
        return self.cores

    def port_in_use(self, port: int, host: str = "localhost") -> bool:
        return port in self.busy_ports

    def free_port(self) -> int:
        return self.next_free_port

    def which(self, program: str) -> str | None:
        return self.programs.get(program)

    def command_output(self, argv: list[str]) -> str:
        return self.outputs.get(" ".join(argv), "")

    def nvidia_gpus(self) -> list[tuple[str, str]]:
        return list(self.gpus)

    def python(self) -> str:
        return self.python_path


#: the real machine; created on first use
_LOCAL: HostProbe | None = None


def local_host() -> HostProbe:
    global _LOCAL
    if _LOCAL is None:
        _LOCAL = HostProbe()
    return _LOCAL
