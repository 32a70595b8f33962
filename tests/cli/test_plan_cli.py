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


def test_plan_names_which_facts_of_the_environment_changed(tmp_path, monkeypatch):
    """The README promises `plan` says which input changed: for the environment that is the version, device or host
    fact that moved since the step last ran, not the bare word "environment"."""
    from transformers import GPT2Config

    from prefect_accelerate.pipeline import graph as graph_module
    from prefect_accelerate.pipeline import index
    from prefect_accelerate.pipeline.models import MemorySettings, PipelineRequest

    monkeypatch.setenv("PREFECT_ACCELERATE_STATE_DIR", str(tmp_path / "state"))
    model = tmp_path / "tiny-gpt2"
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64).save_pretrained(model)
    config = tmp_path / "cpu.yaml"
    config.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n")
    request = PipelineRequest(script=str(EXAMPLE), config_file=str(config), model=str(model),
                              memory=MemorySettings(device_memory="8GiB"), run_install_test=False)
    graph = graph_module.build_graph(request)
    for step in graph.enabled():
        if step.key:  # as a finished pipeline run leaves them
            index.record(graph.pipeline_id, step.name, step.key, step.inputs)
    assert all(s.status == "would use cache" for s in graph_module.build_graph(request).enabled() if s.name != "launch")

    real = graph_module.environment_fingerprint()
    monkeypatch.setattr(graph_module, "environment_fingerprint", lambda: {**real, "torch": "9.9.9", "python": "3.99.0"})
    graph = graph_module.build_graph(request)
    assert graph.step("env").reason == f"environment changed (python {real['python']} -> 3.99.0, torch {real['torch']} -> 9.9.9)"
    assert graph.step("memory").reason == f"model libraries changed (torch {real['torch']} -> 9.9.9)"
    assert graph.step("config").status == "would use cache"
