"""The `env` report as text (the lines `accelerate env` prints, plus ours) and as markdown.

The text keeps `accelerate env`'s layout and key order (reference §2.4) so a report pastes into an
Accelerate issue unchanged, with two deliberate renames: the version and executable lines are
prefect-accelerate's, and Accelerate's own version follows on a line of its own. Our additions come
after Accelerate's lines and before the config section.
"""

from __future__ import annotations

from typing import Any

from prefect_accelerate.envreport.importcheck import IMPORT_CHECK_CACHE_ENV
from prefect_accelerate.envreport.probe import EXECUTABLE, EngineStatus, EnvReport

HEADER = "Copy-and-paste the text below in your GitHub issue"
DEFAULT_CONFIG_TITLE = "`Accelerate` default config"
PASSED_CONFIG_TITLE = "`Accelerate` config passed"
NOT_FOUND = "Not found"
NOT_AVAILABLE = "N/A"

_SOURCE_WORDS = {"passed": "passed with --config_file", "default": "default", "legacy-default": "legacy default"}


def _or_na(value: object) -> str:
    return NOT_AVAILABLE if value is None else str(value)


def accelerate_items(report: EnvReport) -> list[tuple[str, str]]:
    """The lines `accelerate env` prints before its config, in its order (with our two renames)."""
    items = [
        (f"`{EXECUTABLE}` version", report.prefect_accelerate_version),
        ("`Accelerate` version", report.accelerate_version or "not installed"),
        ("Platform", report.platform),
        (f"`{EXECUTABLE}` bash location", report.executable or NOT_FOUND),
        ("Python version", report.python_version),
        ("Numpy version", report.numpy_version or "not installed"),
        ("PyTorch version", report.torch_version or "not installed"),
        ("PyTorch accelerator", report.accelerator),
        ("System RAM", f"{report.system_ram_gb:.2f} GB"),
    ]
    if report.torch_error:
        items.insert(items.index(("PyTorch accelerator", report.accelerator)), ("PyTorch import error", report.torch_error))
    if report.device_line is not None:
        items.append((report.device_line[0], report.device_line[1]))
    return items


def engine_text(engine: EngineStatus) -> str:
    if not engine.installed:
        return "not installed"
    version = engine.version or "unknown version"
    if engine.importable:
        return f"{version}, importable"
    if engine.importable is False:
        return f"{version}, installed but not importable ({engine.error})"
    return f"{version}, installed ({engine.error or 'import not checked'})"


def config_location_text(report: EnvReport) -> str:
    config = report.config
    if config.path is None:
        looked = " and ".join(config.searched)
        return f"{NOT_FOUND} (looked for {looked})" if looked else NOT_FOUND
    return f"{config.path} ({_SOURCE_WORDS.get(config.source or '', config.source)})"


def extra_items(report: EnvReport) -> list[tuple[str, str]]:
    """Our lines after Accelerate's: Prefect, the CUDA stack, every accelerator, CPUs, engines, config file."""
    items = [
        ("Prefect version", report.prefect_version or "not installed"),
        ("Prefect API URL", report.prefect_api_description),
        ("CUDA version", _or_na(report.cuda_version)),
        ("cuDNN version", _or_na(report.cudnn_version)),
        ("NCCL version", _or_na(report.nccl_version)),
    ]
    if report.accelerators:
        for device in report.accelerators:
            memory = f"{device.total_memory_gb:.2f} GB" if device.total_memory_gb is not None else "memory unknown"
            items.append((f"Accelerator {device.kind}:{device.index}", f"{device.name}, {memory}"))
    else:
        items.append(("Accelerators", "none"))
    physical = _or_na(report.cpu_cores_physical)
    logical = _or_na(report.cpu_cores_logical)
    items.append(("CPU cores", f"{physical} physical, {logical} logical"))
    for engine in report.engines:
        items.append((f"`{engine.name}`", engine_text(engine)))
    if report.import_check_reused_from:
        items.append(("Import check", f"reused from {report.import_check_reused_from}, the installation unchanged since "
                                      f"({IMPORT_CHECK_CACHE_ENV}=0 imports again)"))
    items.append(("`Accelerate` config file", config_location_text(report)))
    return items


def config_title(report: EnvReport) -> str:
    return PASSED_CONFIG_TITLE if report.config.passed else DEFAULT_CONFIG_TITLE


def render_text(report: EnvReport) -> str:
    """The report as `accelerate env` prints it (same lines, same order), plus our lines.

    Returns:
        The text without a trailing newline; `print` it.
    """
    lines = ["", HEADER, ""]
    lines += [f"- {key}: {value}" for key, value in accelerate_items(report) + extra_items(report)]
    lines.append(f"- {config_title(report)}:")
    if report.config.entries is None:
        lines.append(f"\t{NOT_FOUND}")
    else:
        lines += [f"\t- {key}: {value}" for key, value in report.config.entries.items()]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return f"`{text}`" if text else " "


def render_markdown(report: EnvReport) -> str:
    """The report for a Prefect artifact: a table of the facts, then one of the config entries."""
    lines = ["## Environment", "", "| Item | Value |", "| --- | --- |"]
    for key, value in accelerate_items(report) + extra_items(report):
        lines.append(f"| {key.replace('|', chr(92) + '|')} | {_cell(value)} |")
    lines += ["", f"## {config_title(report)}", ""]
    if report.config.entries is None:
        lines.append(config_location_text(report))
    else:
        lines += [f"File: `{report.config.path}` ({_SOURCE_WORDS.get(report.config.source or '', report.config.source)})", ""]
        lines += ["| Key | Value |", "| --- | --- |"]
        lines += [f"| {key} | {_cell(value)} |" for key, value in report.config.entries.items()]
    return "\n".join(lines) + "\n"
