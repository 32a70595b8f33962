"""The `env` report: what this machine has, as one pydantic model a flow can gate on.

`collect_env_report` gathers what `accelerate env` prints (reference §2.4) plus what a Prefect user
needs in a bug report. It never imports prefect (versions come from the distribution metadata) and
reports a missing executable or a broken optional package as text, never as an exception. The only
error it raises is the ConfigError of a bad config file, as every command that reads one does.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from prefect_accelerate._version import __version__
from prefect_accelerate.envreport.importcheck import IMPORT_CHECK_TIMEOUT_S, ImportCheck
from prefect_accelerate.envreport.prefectapi import EPHEMERAL, prefect_api
from prefect_accelerate.signals import raise_if_stopped

#: The executable whose location the report shows (Accelerate shows `accelerate`'s).
EXECUTABLE = "prefect-accelerate"

GIB = 1024**3


class AcceleratorDevice(BaseModel):
    """One accelerator as torch sees it."""

    model_config = ConfigDict(frozen=True)

    kind: str = Field(description="torch device type: cuda, xpu, npu, mlu or mps")
    index: int
    name: str
    total_memory_bytes: int | None = None

    @property
    def total_memory_gb(self) -> float | None:
        return None if self.total_memory_bytes is None else round(self.total_memory_bytes / GIB, 2)


class EngineStatus(BaseModel):
    """An optional engine: installed (and which version), and whether `import` works here."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(description="import name, e.g. deepspeed")
    installed: bool
    version: str | None = Field(None, description="distribution version from its metadata")
    importable: bool | None = Field(None, description="None when the import was not tried or did not finish")
    error: str | None = Field(None, description="why the import failed or was not checked")


ConfigSource = Literal["passed", "default", "legacy-default"]


class ConfigReport(BaseModel):
    """The Accelerate config `env` shows: which file, and its entries (None when there is none)."""

    model_config = ConfigDict(frozen=True)

    passed: bool = Field(description="True when --config_file was given (Accelerate's 'config passed' header)")
    path: str | None = None
    source: ConfigSource | None = None
    entries: dict[str, Any] | None = Field(None, description="the file's to_dict() in declaration order")
    searched: list[str] = Field(default_factory=list, description="default locations looked at when none was found")

    @property
    def found(self) -> bool:
        return self.entries is not None


class EnvReport(BaseModel):
    """Everything `prefect-accelerate env` reports about this machine."""

    model_config = ConfigDict(frozen=True)

    prefect_accelerate_version: str
    accelerate_version: str | None = Field(description="installed Accelerate, None when not installed")
    platform: str
    executable: str | None = Field(description=f"where `{EXECUTABLE}` is on PATH, None when it is not")
    python_version: str
    numpy_version: str | None
    torch_version: str | None
    torch_error: str | None = Field(None, description="why torch could not be imported, when it could not")
    accelerator: str = Field(description="CUDA, XPU, NPU, MLU, MPS or N/A, as `accelerate env` prints it")
    system_ram_gb: float
    device_line: tuple[str, str] | None = Field(
        None, description="the device line of `accelerate env`, e.g. ('GPU type', 'NVIDIA H100'); None on CPU"
    )
    prefect_version: str | None
    prefect_api_url: str | None = Field(description="None: the embedded ephemeral server")
    prefect_api_source: str
    cuda_version: str | None = None
    cudnn_version: str | None = None
    nccl_version: str | None = None
    accelerators: list[AcceleratorDevice] = Field(default_factory=list)
    cpu_cores_physical: int | None
    cpu_cores_logical: int | None
    engines: list[EngineStatus] = Field(default_factory=list)
    import_check_reused_from: str | None = Field(
        None, description="when the engines' import check was reused from an earlier one (UTC, ISO 8601), else None"
    )
    config: ConfigReport

    @property
    def accelerator_count(self) -> int:
        return len(self.accelerators)

    @property
    def prefect_api_description(self) -> str:
        return f"{self.prefect_api_url} (from {self.prefect_api_source})" if self.prefect_api_url else EPHEMERAL

    def engine(self, name: str) -> EngineStatus | None:
        """The status of one optional engine by import name (deepspeed, torch_xla, ...)."""
        return next((e for e in self.engines if e.name == name), None)


def _utc(seconds: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat(timespec="seconds")


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def config_report(config_file: str | os.PathLike[str] | None = None) -> ConfigReport:
    """Load the config `env` shows: `config_file`, else the default (YAML, then legacy JSON).

    Raises:
        ConfigError: the file given, or the default file found, is missing, unreadable or invalid.
    """
    from prefect_accelerate.config.io import load_config_file
    from prefect_accelerate.config.paths import searched_locations

    loaded = load_config_file(config_file, required=False)
    if loaded is None:
        return ConfigReport(passed=False, searched=[str(p) for p in searched_locations()])
    data = loaded.config.to_dict()
    order = [name for name in loaded.config.field_order() if name in data]
    entries = {name: data[name] for name in order + [n for n in data if n not in order]}
    return ConfigReport(
        passed=config_file is not None, path=str(loaded.location.path), source=loaded.location.source, entries=entries
    )


def _torch_facts() -> dict[str, Any]:
    """torch's version, accelerator, devices and CUDA stack; a torch that will not import is reported."""
    try:
        import torch
    except Exception as error:  # a broken install should still give a report to paste
        return {"torch_version": _version("torch"), "torch_error": f"{type(error).__name__}: {error}"[:300]}
    from prefect_accelerate.envreport.devices import detect_accelerator, device_line

    info = detect_accelerator()
    facts: dict[str, Any] = {
        "torch_version": str(torch.__version__),
        "accelerator": info.label,
        "device_line": device_line(info),
        "accelerators": [
            AcceleratorDevice(kind=info.kind or "", index=d.index, name=d.name, total_memory_bytes=d.total_memory)
            for d in info.devices
        ],
        "cuda_version": getattr(torch.version, "cuda", None),
    }
    try:
        cudnn = torch.backends.cudnn.version()
    except Exception:
        cudnn = None
    facts["cudnn_version"] = None if cudnn is None else str(cudnn)
    try:  # a CPU build has no NCCL at all (AttributeError from torch._C)
        nccl = torch.cuda.nccl.version()
        facts["nccl_version"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception:
        facts["nccl_version"] = None
    return facts


def collect_env_report(
    config_file: str | os.PathLike[str] | None = None,
    *,
    check_imports: bool = True,
    import_timeout: float = IMPORT_CHECK_TIMEOUT_S,
) -> EnvReport:
    """Probe this machine for the `env` report.

    Args:
        config_file: the Accelerate config to show; None shows the default one, if any.
        check_imports: import each installed optional engine in a child process to learn whether it
            works (a few seconds, overlapped with the rest); False reports installed versions only.
        import_timeout: seconds the import check may take before the rest is reported unchecked.

    Returns:
        The report; render it with `prefect_accelerate.envreport.render`.

    Raises:
        ConfigError: the config file is missing (when given), unreadable or invalid.

    Example:
        >>> report = collect_env_report(check_imports=False)
        >>> report.accelerator in ("CUDA", "XPU", "NPU", "MLU", "MPS", "N/A")
        True
    """
    import psutil

    config = config_report(config_file)  # first: a bad file fails before any process starts
    api = prefect_api()
    with ImportCheck(check_imports=check_imports, timeout=import_timeout) as imports:
        facts = _torch_facts()
        raise_if_stopped()  # `import torch` swallows a Ctrl-C that lands inside it: no half-made report
        engines = [
            EngineStatus(name=p.module, installed=p.installed, version=p.version, importable=p.importable, error=p.error)
            for p in imports.results()
        ]
        reused = imports.reused_from
    return EnvReport(
        prefect_accelerate_version=__version__,
        accelerate_version=_version("accelerate"),
        platform=platform.platform(),
        executable=shutil.which(EXECUTABLE),
        python_version=platform.python_version(),
        numpy_version=_version("numpy"),
        torch_version=facts.get("torch_version"),
        torch_error=facts.get("torch_error"),
        accelerator=facts.get("accelerator", "N/A"),
        system_ram_gb=round(psutil.virtual_memory().total / GIB, 2),
        device_line=facts.get("device_line"),
        prefect_version=_version("prefect"),
        prefect_api_url=api.url,
        prefect_api_source=api.source,
        cuda_version=facts.get("cuda_version"),
        cudnn_version=facts.get("cudnn_version"),
        nccl_version=facts.get("nccl_version"),
        accelerators=facts.get("accelerators", []),
        cpu_cores_physical=psutil.cpu_count(logical=False),
        cpu_cores_logical=psutil.cpu_count(logical=True),
        engines=engines,
        import_check_reused_from=None if reused is None else _utc(reused),
        config=config,
    )
