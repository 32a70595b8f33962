"""What a Prefect user sees of a tracked pipeline, read back through the API the UI uses (the run graph
endpoint, task runs, artifacts, logs): the DAG as Prefect's graph, an artifact for every gate in every run
it gated, names and keys that tell pipelines apart, and an expected failure as one error without a traceback."""

from __future__ import annotations

from pathlib import Path
from uuid import UUID

import pytest

from prefect_accelerate.pipeline.models import MemorySettings, PipelineRequest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "ddp_allreduce.py")
CPU = {"cpu": True, "num_processes": 2, "mixed_precision": "no", "dynamo_backend": "no", "num_machines": 1}

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]

#: the DAG with every step of a CPU launch with a model: config -> (env || memory) -> memory-fit -> install-test -> launch
WITH_MODEL = {("config", "env"), ("config", "memory"), ("env", "memory-fit"), ("memory", "memory-fit"),
              ("memory-fit", "install-test"), ("install-test", "launch")}


@pytest.fixture(autouse=True)
def own_state(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_ACCELERATE_STATE_DIR", str(tmp_path / "state"))


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> str:
    from transformers import GPT2Config

    folder = tmp_path_factory.mktemp("models") / "tiny-gpt2"
    GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128).save_pretrained(folder)
    return str(folder)


def _get(path: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        response = client._client.get(path)
        response.raise_for_status()
        return response.json()


def _step(label: str) -> str:
    """A task run's step: `memory-fit-cpu.yaml` -> memory-fit; the launch task is `launch-<launcher>-...`."""
    from prefect_accelerate.pipeline.models import STEP_NAMES

    return next(name for name in sorted(STEP_NAMES, key=len, reverse=True) if label == name or label.startswith(name + "-"))


def graph_of(flow_run_id: UUID) -> tuple[dict[str, str], set[tuple[str, str]]]:
    """(step -> state type, edges) of a flow run, from the endpoint Prefect's run graph is drawn from."""
    graph = _get(f"/flow_runs/{flow_run_id}/graph-v2")
    nodes = {node_id: node for node_id, node in graph["nodes"]}
    steps = {_step(node["label"]): node["state_type"] for node in nodes.values()}
    edges = {(_step(nodes[parent["id"]]["label"]), _step(node["label"])) for node in nodes.values() for parent in node["parents"]}
    assert len(steps) == len(nodes), f"a step ran twice: {[n['label'] for n in nodes.values()]}"
    return steps, edges


def artifacts_of(flow_run_id: UUID) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))


def logs_of(flow_run_id: UUID, last: str = "Finished in state Failed") -> list:
    """The run's log records, once the flow's last record has reached the server (logs go in batches)."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + 60
    while True:
        with get_client(sync_client=True) as client:
            records = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        if any(r.message.startswith(last) and r.task_run_id is None for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def run(request: PipelineRequest):
    from prefect_accelerate.flows.pipeline import launch_training

    state = launch_training(request, return_state=True)
    flow_run_id = state.state_details.flow_run_id
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
    return state, flow_run


def kinds(artifacts: list, request: PipelineRequest) -> set[str]:
    """The artifact kinds of this pipeline (`memory-fit` of `memory-fit-<pipeline>`)."""
    from prefect_accelerate.pipeline.naming import artifact_key

    suffix = artifact_key("", request)
    return {a.key[: -len(suffix)] for a in artifacts if a.key and a.key.endswith(suffix)}


def test_the_graph_is_the_dag_fresh_and_cached_with_every_gate_artifact_in_each_run(tiny_gpt2):
    request = PipelineRequest(script=EXAMPLE, launch_flags=CPU, model=tiny_gpt2, memory=MemorySettings(device_memory="8GiB"))
    runs = [run(request.model_copy(update={"force": ["all"]})), run(request)]
    gates = {"config-check", "env-report", "memory-estimate", "memory-fit", "install-test", "pipeline-summary"}
    for (state, flow_run), expected_state in zip(runs, ("COMPLETED", "COMPLETED")):
        assert state.is_completed(), state.message
        steps, edges = graph_of(flow_run.id)
        assert edges == WITH_MODEL
        assert set(steps) == {"config", "env", "memory", "memory-fit", "install-test", "launch"}
        found = artifacts_of(flow_run.id)
        assert kinds(found, request) >= gates, [a.key for a in found]
        assert "launch-result" in kinds(found, request)  # the launch's own artifact, under this pipeline's key
        fit = next(a for a in found if a.key.startswith("memory-fit-"))
        assert fit.task_run_id is not None and fit.description.startswith("fits: ") and " usable" in fit.description
        # a re-published artifact says it came from the cache; a fresh one does not
        env_report = next(a for a in found if a.key.startswith("env-report-"))
        assert ("from the cache" in (env_report.description or "")) == (flow_run.id == runs[1][1].id), env_report.description
    fresh, cached = (state.result() for state, _ in runs)
    assert {s.step: s.status for s in fresh.preflight.steps if s.step != "env"} == {
        "config": "ran", "memory": "ran", "memory-fit": "ran", "deepspeed-check": "skipped", "install-test": "ran"}
    assert {s.step: s.status for s in cached.preflight.steps} == {
        "config": "cached", "env": "cached", "memory": "cached", "memory-fit": "cached", "deepspeed-check": "skipped",
        "install-test": "cached"}
    assert cached.preflight.step("memory-fit").reason.startswith("fits: ")
    # the same pipeline: the same run name and artifact keys, so a key's history is this pipeline's
    assert runs[0][1].name == runs[1][1].name
    assert sorted(a.key for a in artifacts_of(runs[0][1].id)) == sorted(a.key for a in artifacts_of(runs[1][1].id))


def test_a_pipeline_without_a_model_is_config_env_launch_and_named_apart(tiny_gpt2, tmp_path):
    config = tmp_path / "cpu.yaml"
    config.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\nmixed_precision: 'no'\n")
    plain = PipelineRequest(script=EXAMPLE, config_file=str(config), launch_flags={"dynamo_backend": "no"}, run_install_test=False)
    state, flow_run = run(plain)
    assert state.is_completed(), state.message
    steps, edges = graph_of(flow_run.id)
    assert edges == {("config", "env"), ("env", "launch")} and set(steps) == {"config", "env", "launch"}
    assert kinds(artifacts_of(flow_run.id), plain) >= {"config-check", "env-report", "pipeline-summary"}
    assert flow_run.name == "launch-training-torchrun-cpu-cpu.yaml-ddp_allreduce"

    with_model = plain.model_copy(update={"model": tiny_gpt2, "memory": MemorySettings(device_memory="8GiB")})
    _, other = run(with_model)
    assert other.name == "launch-training-torchrun-cpu-cpu.yaml-ddp_allreduce-tiny-gpt2"
    keys = {a.key for a in artifacts_of(flow_run.id)}
    other_keys = {a.key for a in artifacts_of(other.id)}
    assert "launch-result" in kinds(artifacts_of(flow_run.id), plain) and not keys & other_keys


def test_a_run_that_does_not_fit_stops_at_memory_fit_with_one_error_and_no_traceback(tiny_gpt2):
    # 7.55 MiB per device needed, 7.20 MiB usable: gradient checkpointing would make it fit
    request = PipelineRequest(script=EXAMPLE, launch_flags=CPU, model=tiny_gpt2, memory=MemorySettings(device_memory="8MiB"))
    state, flow_run = run(request)
    assert state.is_failed()
    steps, edges = graph_of(flow_run.id)
    assert edges == {("config", "env"), ("config", "memory"), ("env", "memory-fit"), ("memory", "memory-fit")}
    assert steps["memory-fit"] == "FAILED" and "launch" not in steps
    message = flow_run.state.message
    # the verdict's advice once: the smallest change, or that none of the changes tried buys enough room
    advice = message.count("Smallest change") + message.count("None of the changes we try")
    assert advice == 1 and "(given)" not in message and "--device_memory" in message

    records = logs_of(flow_run.id)
    errors = [r for r in records if r.level >= 40]
    assert len(errors) == 1 and "Does not fit" in errors[0].message, [e.message for e in errors]
    assert not [r.message for r in records if "Traceback" in r.message or "NoneType: None" in r.message]

    found = artifacts_of(flow_run.id)
    assert kinds(found, request) >= {"memory-estimate", "memory-fit", "pipeline-summary"}
    assert not [a for a in found if a.key is None and a.task_run_id is None], "the flow run stored its exception as a result artifact"
    summary = next(a for a in found if a.key.startswith("pipeline-summary-"))
    assert summary.description.count("Smallest change") + summary.description.count("None of the changes we try") == 1

    from prefect_accelerate.errors import PreflightError
    from prefect_accelerate.flows.pipeline import launch_training

    with pytest.raises(PreflightError, match="Preflight step memory-fit failed: Does not fit"):  # Python callers still get the error
        launch_training(request)
