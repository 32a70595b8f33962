"""`collect_env_report` on this CPU machine, and the config section for every way a config is found."""

from __future__ import annotations

import importlib.metadata
import json

import pytest

from prefect_accelerate.envreport.probe import EnvReport, collect_env_report, config_report
from prefect_accelerate.errors import ConfigError

FSDP_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_version: 2
mixed_precision: bf16
num_processes: 2
downcast_bf16: 'no'
tpu_env: []
"""


def installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


@pytest.fixture(scope="module")
def report() -> EnvReport:
    """One full report, import check included (the slow part), shared by the tests that read it."""
    return collect_env_report(check_imports=True)


def test_report_on_a_cpu_machine_has_no_accelerator(report):
    assert report.accelerator == "N/A"
    assert report.device_line is None
    assert report.accelerators == [] and report.accelerator_count == 0
    assert report.cuda_version is None and report.nccl_version is None and report.cudnn_version is None


def test_report_counts_memory_and_cores(report):
    assert report.system_ram_gb > 0
    assert report.cpu_cores_logical >= 1
    assert report.cpu_cores_physical is None or 1 <= report.cpu_cores_physical <= report.cpu_cores_logical


def test_report_versions_match_the_installed_distributions(report):
    from prefect_accelerate import __version__

    assert report.prefect_accelerate_version == __version__
    assert report.accelerate_version == installed("accelerate")
    assert report.prefect_version == installed("prefect")
    assert report.numpy_version == installed("numpy")
    assert report.torch_version == installed("torch")
    for engine in report.engines:
        assert engine.version == installed(engine.name), engine.name


def test_report_checks_each_installed_engine_by_importing_it(report):
    assert [e.name for e in report.engines] == ["deepspeed", "torch_xla", "sagemaker", "transformers", "timm"]
    for engine in report.engines:
        if engine.installed:
            # the test session puts the torchvision shim on PYTHONPATH, so everything installed imports
            assert engine.importable is True, (engine.name, engine.error)
        else:
            assert engine.importable is False and engine.version is None


def test_report_without_import_check_lists_installed_engines_unchecked():
    report = collect_env_report(check_imports=False)
    for engine in report.engines:
        assert engine.importable is (None if engine.installed else False)


def test_report_round_trips_through_json(report):
    again = EnvReport.model_validate_json(report.model_dump_json())
    assert again == report
    assert json.loads(again.model_dump_json()) == json.loads(report.model_dump_json())


def test_report_says_not_found_when_the_executable_is_not_on_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    report = collect_env_report(check_imports=False)
    assert report.executable is None
    from prefect_accelerate.envreport.render import render_text

    assert "- `prefect-accelerate` bash location: Not found" in render_text(report).splitlines()


# --- the config section ---------------------------------------------------------------------------


def test_config_passed_is_shown_in_declaration_order(tmp_path):
    path = tmp_path / "fsdp.yaml"
    path.write_text(FSDP_YAML)
    config = config_report(path)
    assert config.passed and config.source == "passed" and config.path == str(path)
    assert list(config.entries)[:6] == ["compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "num_processes"]
    assert config.entries["fsdp_config"] == {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_version": 2}
    assert config.entries["tpu_env"] == [] and config.entries["downcast_bf16"] == "no"


def test_default_config_is_found_under_hf_home(hf_home):
    (hf_home / "accelerate").mkdir(parents=True)
    (hf_home / "accelerate" / "default_config.yaml").write_text(FSDP_YAML)
    config = config_report()
    assert not config.passed and config.source == "default"
    assert config.path == str(hf_home / "accelerate" / "default_config.yaml")
    assert config.entries["distributed_type"] == "FSDP"


def test_legacy_json_default_is_found_when_no_yaml_exists(hf_home):
    (hf_home / "accelerate").mkdir(parents=True)
    (hf_home / "accelerate" / "default_config.json").write_text(json.dumps({"distributed_type": "NO", "mixed_precision": "fp16"}))
    config = config_report()
    assert config.source == "legacy-default" and config.path.endswith("default_config.json")
    assert config.entries["mixed_precision"] == "fp16" and config.entries["num_processes"] == 1


def test_no_config_anywhere_is_not_found_with_the_places_looked_at(hf_home):
    config = config_report()
    assert not config.found and config.entries is None and config.path is None
    assert config.searched == [str(hf_home / "accelerate" / "default_config.yaml"), str(hf_home / "accelerate" / "default_config.json")]


def test_a_missing_passed_config_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        collect_env_report(tmp_path / "nope.yaml", check_imports=False)


def test_a_broken_default_config_is_a_config_error(hf_home):
    (hf_home / "accelerate").mkdir(parents=True)
    (hf_home / "accelerate" / "default_config.yaml").write_text("distributed_type: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        collect_env_report(check_imports=False)


def test_a_reused_import_check_is_said_in_the_report(tmp_path, monkeypatch):
    from prefect_accelerate.envreport.render import render_text

    monkeypatch.setenv("PREFECT_ACCELERATE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PREFECT_ACCELERATE_IMPORT_CHECK_CACHE", raising=False)
    first = collect_env_report(check_imports=True)
    assert all(e.importable for e in first.engines if e.installed)  # a check with a failure is never reused
    second = collect_env_report(check_imports=True)
    assert first.import_check_reused_from is None and second.import_check_reused_from is not None
    assert [(e.name, e.importable) for e in second.engines] == [(e.name, e.importable) for e in first.engines]
    assert "Import check: reused from " in render_text(second) and "Import check" not in render_text(first)
