"""The Prefect side: the cached `estimate_memory` task, its artifact, the `memory_fit` gate, the tracked CLI."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from prefect_accelerate.errors import PreflightError
from prefect_accelerate.memory import EstimateOptions

pytestmark = pytest.mark.slow  # a Prefect test server (session-wide) and several flow runs

OPTIONS = EstimateOptions(dtypes=("float32",), strategy="ddp", seq_len=32)


def test_estimate_task_returns_the_model_and_publishes_a_table_artifact(prefect_harness, zoo):
    from prefect import flow
    from prefect.artifacts import Artifact

    from prefect_accelerate.tasks.memory import ESTIMATE_ARTIFACT_KEY, estimate_memory

    @flow
    def sized():
        return estimate_memory(str(zoo["tiny-gpt2"]), OPTIONS.model_copy(update={"batch_size": 3}))

    result = sized()
    assert result.breakdown.trained_class == "GPT2LMHeadModel"
    artifact = Artifact.get(ESTIMATE_ARTIFACT_KEY)
    assert artifact is not None and artifact.type == "markdown"
    text = artifact.data
    # the model named once, the per-device total first, one unit system (binary) throughout
    # the heading names the model; the source line says where it was read from (it was three times)
    assert text.count(str(zoo["tiny-gpt2"])) <= 2 and "**total (peak)**" in text
    assert text.index("per device**") < text.index("Accelerate's table") and "table above" not in text
    assert not re.search(r"\d (KB|MB|GB)\b", text)


def test_estimate_is_cached_across_runs_on_config_content_and_options(prefect_harness, zoo, tmp_path):
    from prefect import flow

    from prefect_accelerate.tasks.memory import estimate_memory

    folder = tmp_path / "model"
    shutil.copytree(zoo["tiny-bert"], folder)

    @flow
    def sized(options: EstimateOptions):
        return estimate_memory(str(folder), options, return_state=True)

    first = sized(OPTIONS)
    again = sized(OPTIONS)
    assert first.name == "Completed"
    assert again.name == "Cached"
    assert again.result().model_dump() == first.result().model_dump()
    assert sized(OPTIONS.model_copy(update={"batch_size": 2})).name != "Cached"
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    changed = sized(OPTIONS)
    assert changed.name != "Cached"
    assert changed.result().profile.parameters > first.result().profile.parameters


def test_memory_fit_gate_fails_with_the_verdict(prefect_harness, zoo):
    from prefect import flow

    from prefect_accelerate.tasks.memory import estimate_memory, memory_fit

    @flow
    def preflight(device_memory: str):
        return memory_fit(estimate_memory(str(zoo["tiny-gpt2"]), OPTIONS), device_memory)

    assert preflight("8GiB").fits
    with pytest.raises(PreflightError, match="Does not fit"):
        preflight("1MiB")


def test_flow_reports_without_gating_unless_asked(prefect_harness, zoo):
    from prefect_accelerate.flows.memory import estimate_memory_flow

    result, verdict = estimate_memory_flow(str(zoo["tiny-gpt2"]), OPTIONS, device_memory="1MiB")
    assert result.breakdown is not None and not verdict.fits
    with pytest.raises(PreflightError):
        estimate_memory_flow(str(zoo["tiny-gpt2"]), OPTIONS, device_memory="1MiB", gate=True)


def test_tracked_cli_prints_the_same_report(prefect_harness, zoo, monkeypatch, capsys):
    from prefect_accelerate.cli import main as cli_main

    module = "prefect_accelerate.cli.estimate_cmd"
    if module not in cli_main.COMMAND_MODULES:
        monkeypatch.setattr(cli_main, "COMMAND_MODULES", (*cli_main.COMMAND_MODULES, module))
    argv = ["estimate-memory", str(zoo["tiny-gpt2"]), "--dtypes", "float32", "--seq_len", "32", "--device_memory", "8GiB"]
    assert cli_main.main([*argv, "--no-track"]) == 0
    untracked = capsys.readouterr().out
    assert cli_main.main([*argv, "--track"]) == 0
    assert capsys.readouterr().out == untracked
