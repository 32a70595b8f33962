"""`prefect-accelerate env` as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from prefect_accelerate.cli.main import main
from prefect_accelerate.envreport.probe import EnvReport

QUICK = ["env", "--no-track", "--no-import-check"]


def cli(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prefect_accelerate.cli.main", *args], capture_output=True, text=True, timeout=300, **kwargs)


def write_default(hf_home, name="default_config.yaml", text="distributed_type: NO\nmixed_precision: bf16\n"):
    (hf_home / "accelerate").mkdir(parents=True, exist_ok=True)
    path = hf_home / "accelerate" / name
    path.write_text(text)
    return path


def test_env_json_parses_into_the_report(capsys, hf_home):
    assert main([*QUICK, "--json"]) == 0
    out = capsys.readouterr().out
    report = EnvReport.model_validate_json(out)
    assert json.loads(report.model_dump_json()) == json.loads(out)
    assert report.config.entries is None and report.accelerator == "N/A"


def test_env_says_which_default_file_it_used(capsys, hf_home):
    path = write_default(hf_home)
    assert main(QUICK) == 0
    captured = capsys.readouterr()
    assert captured.err.strip() == f"Using the default config file {path}"
    assert "- `Accelerate` default config:\n\t- compute_environment: LOCAL_MACHINE\n\t- distributed_type: NO\n\t- mixed_precision: bf16" in captured.out


def test_env_says_when_it_used_a_legacy_json_default(capsys, hf_home):
    path = write_default(hf_home, "default_config.json", '{"distributed_type": "NO"}')
    assert main(QUICK) == 0
    assert capsys.readouterr().err.strip() == f"Using the legacy default config file {path} (no default_config.yaml was found)"


def test_env_with_a_passed_config_says_nothing_on_stderr(capsys, tmp_path, hf_home):
    write_default(hf_home)
    path = tmp_path / "mine.yaml"
    path.write_text("distributed_type: MULTI_CPU\nnum_processes: 4\n")
    assert main([*QUICK, "--config-file", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "- `Accelerate` config passed:" in captured.out and "\t- distributed_type: MULTI_CPU" in captured.out


def test_env_with_a_broken_config_exits_2_without_a_traceback(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("distributed_type: FSDP\nfsdp_config: [\n")
    result = cli(*QUICK, "--config_file", str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith(f"error: The config file {path} is not valid YAML")
    assert "Traceback" not in result.stderr


def test_env_untracked_checks_every_engine_without_importing_prefect():
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "prefect_accelerate.cli.main", "env", "--no-track"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" in imported  # the measurement works
    assert not {name for name in imported if name == "prefect" or name.startswith("prefect.")}
    lines = result.stdout.splitlines()
    assert lines[:3] == ["", "Copy-and-paste the text below in your GitHub issue", ""]
    assert any(line.startswith("- `deepspeed`: ") and line.endswith(", importable") for line in lines)
    assert "- `torch_xla`: not installed" in lines


@pytest.mark.parametrize("flag", ["--no-import-check", "--no_import_check"])
def test_env_import_check_flag_takes_both_spellings(flag, capsys, hf_home):
    assert main(["env", "--no-track", flag, "--json"]) == 0
    report = EnvReport.model_validate_json(capsys.readouterr().out)
    assert all(e.importable is None for e in report.engines if e.installed)
