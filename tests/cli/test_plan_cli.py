"""`prefect-accelerate plan`: the DAG, statuses and the launch plan for a fixed example, pinned by a golden file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.golden import assert_golden, normalize_plan

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "ddp_allreduce.py"


def test_plan_for_the_example_matches_the_golden_file(tmp_path):
    config = tmp_path / "cpu.yaml"
    config.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\nmixed_precision: 'no'\n")
    env = {**os.environ, "PREFECT_ACCELERATE_STATE_DIR": str(tmp_path / "state")}
    run_dir = str(tmp_path / "run")
    argv = [sys.executable, "-m", "prefect_accelerate.cli.main", "plan", "--json", "--config_file", str(config), "--run_dir", run_dir,
            "--dynamo_backend", "no", str(EXAMPLE), "--epochs", "1"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    data["launch_plan"] = normalize_plan(data["launch_plan"], run_dir=run_dir, cwd=str(tmp_path))
    argv_out = [a.replace(sys.executable, "PYTHON").replace(str(REPO), "REPO") for a in data["launch_plan"]["argv"]]
    port = argv_out.index("--master_port") + 1
    argv_out[port] = "PORT"  # 29500, or a free one when something else holds 29500 right now
    data["launch_plan"]["argv"] = argv_out
    data["launch_plan"]["env"].pop("PYTHONUNBUFFERED", None)
    for step in data["steps"]:
        step["key"] = "KEY" if step["key"] else None
        step["inputs"] = sorted(step["inputs"])  # names only: digests depend on this machine
    assert_golden("plan/ddp-example", data)


def test_plan_draws_mermaid_and_dot_without_prefect_or_torch(tmp_path):
    env = {**os.environ, "PREFECT_ACCELERATE_STATE_DIR": str(tmp_path / "state")}
    base = [sys.executable, "-X", "importtime", "-m", "prefect_accelerate.cli.main", "plan", "--cpu", "--num_processes", "2", str(EXAMPLE)]
    mermaid = subprocess.run(base, capture_output=True, text=True, env=env, timeout=120)
    assert mermaid.returncode == 0 and mermaid.stdout.startswith("flowchart LR")
    assert "install_test --> launch" in mermaid.stdout and "would run" in mermaid.stdout
    imported = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in mermaid.stderr.splitlines() if line.startswith("import time:")}
    assert "prefect" not in imported and "torch" not in imported
    dot = subprocess.run([sys.executable, "-m", "prefect_accelerate.cli.main", *base[5:-1], "--format", "dot", str(EXAMPLE)], capture_output=True, text=True, env=env, timeout=120)
    assert dot.stdout.startswith("digraph preflight {") and '"install-test" -> "launch";' in dot.stdout


@pytest.mark.usefixtures("prefect_harness")
def test_plan_track_publishes_the_plan_as_a_table_in_prefect(tmp_path, monkeypatch, capfd):
    from prefect.artifacts import Artifact

    from prefect_accelerate.cli.main import main
    from prefect_accelerate.cli.pipeline_cmd import request_from_args
    from prefect_accelerate.cli.main import build_parser
    from prefect_accelerate.pipeline.naming import artifact_key

    monkeypatch.setenv("PREFECT_ACCELERATE_STATE_DIR", str(tmp_path / "state"))
    argv = ["plan", "--cpu", "--num_processes", "2", "--no_install_test", str(EXAMPLE)]
    assert main([*argv[:1], "--track", *argv[1:]]) == 0
    assert capfd.readouterr().out.startswith("flowchart LR")  # the terminal output is unchanged
    key = artifact_key("pipeline-plan", request_from_args(build_parser().parse_args(argv)))
    artifact = Artifact.get(key)
    assert artifact is not None and artifact.type == "table"
    rows = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
    by_step = {row["step"]: row for row in rows}
    assert by_step["env"]["after"] == "config" and by_step["launch"]["after"] == "env"
    assert by_step["memory"]["status"] == "not needed" and by_step["memory"]["why"] == "no model given"
    assert by_step["config"]["status"] in ("would run", "would use cache") and by_step["config"]["why"]
