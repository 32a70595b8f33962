"""The Prefect side: the `merge_weights` task's artifacts, the tracked CLI path, failures as MergeError."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from prefect_accelerate.errors import MergeError

pytestmark = pytest.mark.slow  # a Prefect test server (session-wide) and flow runs



def artifact_rows(key: str):
    from prefect.artifacts import Artifact

    artifact = Artifact.get(key)
    assert artifact is not None
    return artifact, (json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data)


def test_task_returns_the_result_and_publishes_a_tensor_table_and_progress(prefect_harness, make_checkpoint, tmp_path, sample_state):
    from prefect_accelerate.flows.merge import merge_weights_flow
    from prefect_accelerate.tasks.merge import MERGE_ARTIFACT_KEY, PROGRESS_ARTIFACT_KEY

    result = merge_weights_flow(str(make_checkpoint()), str(tmp_path / "out"))
    assert sorted(load_file(result.weights_path)) == sorted(sample_state)
    table, rows = artifact_rows(MERGE_ARTIFACT_KEY)
    assert table.type == "table" and "9 tensors" in table.description
    assert {r["tensor"] for r in rows[:-1]} == set(sample_state)
    assert {r["dtype"] for r in rows if r["tensor"] == "layers.0.weight"} == {"bfloat16"}
    assert rows[-1]["tensor"] == "total: 9 tensors" and rows[-1]["size"] == "1.08 KB"
    progress, value = artifact_rows(PROGRESS_ARTIFACT_KEY)
    assert progress.type == "progress" and float(value) == 100.0


def test_task_failure_is_the_merge_error(prefect_harness, tmp_path):
    from prefect_accelerate.flows.merge import merge_weights_flow

    with pytest.raises(MergeError, match="does not exist"):
        merge_weights_flow(str(tmp_path / "missing"), str(tmp_path / "out"))


def test_tracked_cli_merges_and_reports_errors_like_the_untracked_one(prefect_harness, make_checkpoint, tmp_path, monkeypatch, capsys):
    from prefect_accelerate.cli import main as cli_main

    monkeypatch.delenv("PREFECT_ACCELERATE_TRACK", raising=False)
    assert cli_main.main(["merge-weights", str(make_checkpoint()), str(tmp_path / "out")]) == 0  # tracked by default
    assert capsys.readouterr().out.startswith("Merged 9 tensors")
    assert cli_main.main(["merge-weights", str(tmp_path / "missing"), str(tmp_path / "out2")]) == 2
    assert "error: The checkpoint folder" in capsys.readouterr().err
