"""The text report against `accelerate env` itself, and the markdown artifact."""

from __future__ import annotations

import argparse

import pytest

from prefect_accelerate.envreport.probe import ConfigReport, EngineStatus, EnvReport, collect_env_report
from prefect_accelerate.envreport.render import extra_items, render_markdown, render_text

pytest.importorskip("accelerate")

#: `accelerate env` keys we print under another name (ours is the tool being reported)
RENAMED = {"`Accelerate` version": "`prefect-accelerate` version", "`accelerate` bash location": "`prefect-accelerate` bash location"}

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


def accelerate_env_text(capsys, config_file=None) -> str:
    from accelerate.commands.env import env_command

    capsys.readouterr()
    env_command(argparse.Namespace(config_file=None if config_file is None else str(config_file)))
    return capsys.readouterr().out.rstrip("\n")


def top_level(text: str) -> list[tuple[str, str]]:
    """The `- key: value` lines (not the tab-indented config entries), as (key, value)."""
    pairs = []
    for line in text.splitlines():
        if line.startswith("- "):
            key, _, value = line[2:].partition(":")
            pairs.append((key, value.strip()))
    return pairs


def test_text_has_the_lines_of_accelerate_env_in_its_order(tmp_path, capsys):
    path = tmp_path / "fsdp.yaml"
    path.write_text(FSDP_YAML)
    theirs = accelerate_env_text(capsys, path)
    report = collect_env_report(path, check_imports=False)
    ours = render_text(report)

    assert ours.splitlines()[:3] == theirs.splitlines()[:3] == ["", "Copy-and-paste the text below in your GitHub issue", ""]
    added = {"`Accelerate` version"} | {key for key, _ in extra_items(report)}
    our_keys = [key for key, _ in top_level(ours) if key not in added]
    assert our_keys == [RENAMED.get(key, key) for key, _ in top_level(theirs)]
    # the facts both tools print agree, and Accelerate's version is on a line of its own
    shared = dict(top_level(theirs))
    mine = dict(top_level(ours))
    for key in ("Platform", "Python version", "Numpy version", "PyTorch version", "PyTorch accelerator", "System RAM"):
        assert mine[key] == shared[key], key
    assert mine["`Accelerate` version"] == shared["`Accelerate` version"]
    # the config section is line for line Accelerate's
    assert ours.split("- `Accelerate` config passed:")[1] == theirs.split("- `Accelerate` config passed:")[1]


def test_text_without_config_ends_like_accelerate_env(hf_home, capsys):
    report = collect_env_report(check_imports=False)
    lines = render_text(report).splitlines()
    assert lines[-2:] == ["- `Accelerate` default config:", "\tNot found"]
    assert "- `Accelerate` config file: Not found (looked for " in "\n".join(lines)


def test_text_places_accelerate_version_after_ours_and_extras_before_the_config():
    report = collect_env_report(check_imports=False)
    keys = [key for key, _ in top_level(render_text(report))]
    assert keys[:2] == ["`prefect-accelerate` version", "`Accelerate` version"]
    assert keys.index("Prefect version") == keys.index("System RAM") + 1
    assert keys[-2:] == ["`Accelerate` config file", "`Accelerate` default config"]


def sample_report(**changes) -> EnvReport:
    base = collect_env_report(check_imports=False)
    return base.model_copy(update=changes)


def test_text_says_when_accelerate_is_not_installed_and_an_engine_does_not_import():
    engine = EngineStatus(name="timm", installed=True, version="1.0.31", importable=False, error="RuntimeError: operator torchvision::nms does not exist")
    text = render_text(sample_report(accelerate_version=None, engines=[engine]))
    assert "- `Accelerate` version: not installed" in text
    assert "- `timm`: 1.0.31, installed but not importable (RuntimeError: operator torchvision::nms does not exist)" in text


def test_text_names_the_api_url_and_where_it_came_from():
    text = render_text(sample_report(prefect_api_url="http://127.0.0.1:4200/api", prefect_api_source="the environment variable PREFECT_API_URL"))
    assert "- Prefect API URL: http://127.0.0.1:4200/api (from the environment variable PREFECT_API_URL)" in text
    assert "- Prefect API URL: none set: the local Prefect server of PREFECT_HOME" in render_text(sample_report(prefect_api_url=None))


def test_markdown_has_a_fact_table_and_a_config_table(tmp_path):
    path = tmp_path / "fsdp.yaml"
    path.write_text(FSDP_YAML)
    markdown = render_markdown(collect_env_report(path, check_imports=False))
    assert "| Item | Value |" in markdown and "| PyTorch accelerator | `N/A` |" in markdown
    assert "## `Accelerate` config passed" in markdown
    assert f"File: `{path}` (passed with --config_file)" in markdown
    assert "| distributed_type | `FSDP` |" in markdown


def test_markdown_escapes_pipes_and_says_not_found():
    report = sample_report(platform="a|b", config=ConfigReport(passed=False, searched=["/x/default_config.yaml"]))
    markdown = render_markdown(report)
    assert "| Platform | `a\\|b` |" in markdown
    assert "Not found (looked for /x/default_config.yaml)" in markdown
