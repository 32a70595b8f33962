"""The preflight pipeline on the session's Prefect test server: resume, exact re-runs, gates, approval, validation."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import pytest

from prefect_accelerate.errors import PreflightError
from prefect_accelerate.pipeline.models import MemorySettings, PipelineRequest, ValidationRequest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "ddp_allreduce.py")
QUIET = {"mixed_precision": "no", "dynamo_backend": "no", "num_machines": 1}

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]


@pytest.fixture(autouse=True)
def own_state(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_ACCELERATE_STATE_DIR", str(tmp_path / "state"))


@pytest.fixture
def tiny_gpt2(tmp_path) -> str:
    from transformers import GPT2Config

    folder = tmp_path / "tiny-gpt2"
    GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128).save_pretrained(folder)
    return str(folder)


def statuses(report) -> dict[str, str]:
    return {s.step: s.status for s in report.steps}


def test_resume_skips_unchanged_steps_and_one_byte_reruns_exactly_its_dependents(tmp_path, tiny_gpt2):
    from prefect_accelerate.flows.pipeline import preflight

    config = tmp_path / "cpu.yaml"
    config.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\nmixed_precision: 'no'\ndebug: false\n")
    request = PipelineRequest(script=EXAMPLE, config_file=str(config), model=tiny_gpt2, memory=MemorySettings(device_memory="8GiB"),
                              launch_flags={"dynamo_backend": "no"})
    first = statuses(preflight(request))
    first.pop("env")  # the environment report may come from an earlier test's run: same machine
    assert first == {"config": "ran", "memory": "ran", "memory-fit": "ran", "deepspeed-check": "skipped", "install-test": "ran"}
    second = preflight(request)
    assert statuses(second) == {"config": "cached", "env": "cached", "memory": "cached", "memory-fit": "cached",
                                "deepspeed-check": "skipped", "install-test": "cached"}

    # one byte that only the config itself and the self-test read
    config.write_text(config.read_text().replace("debug: false", "debug: true "))
    third = preflight(request)
    assert statuses(third) == {"config": "ran", "env": "cached", "memory": "cached", "memory-fit": "cached",
                               "deepspeed-check": "skipped", "install-test": "ran"}

    # a change of layout re-runs the memory steps as well, and --force re-runs a cached step (the self-test,
    # whose re-run on a config change is shown above, is left out: it would cost seconds and show nothing new)
    config.write_text(config.read_text().replace("num_processes: 2", "num_processes: 1"))
    fourth = preflight(request.model_copy(update={"force": ["env"], "run_install_test": False}))
    assert statuses(fourth) == {"config": "ran", "env": "ran", "memory": "ran", "memory-fit": "ran",
                                "deepspeed-check": "skipped", "install-test": "skipped"}


def test_plan_explains_what_changed(tmp_path, tiny_gpt2):
    from prefect_accelerate.flows.pipeline import preflight
    from prefect_accelerate.pipeline.graph import build_graph

    config = tmp_path / "cpu.yaml"
    config.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n")
    request = PipelineRequest(script=EXAMPLE, config_file=str(config), model=tiny_gpt2, memory=MemorySettings(device_memory="8GiB"),
                              run_install_test=False)
    assert {s.name: s.status for s in build_graph(request).enabled()}["config"] == "would run"
    preflight(request)
    graph = build_graph(request)
    assert {s.name: s.status for s in graph.enabled()} == {
        "config": "would use cache", "env": "would use cache", "memory": "would use cache", "memory-fit": "would use cache", "launch": "would run"}
    config.write_text(config.read_text().replace("num_processes: 2", "num_processes: 1"))
    graph = build_graph(request)
    assert graph.step("config").reason == "config file changed"
    assert graph.step("memory").reason == "layout changed"
    assert graph.step("env").status == "would use cache"


def test_a_library_upgrade_reruns_the_memory_estimate(tmp_path, tiny_gpt2, monkeypatch):
    from prefect_accelerate.flows.pipeline import preflight
    from prefect_accelerate.pipeline import graph as graph_module

    config = tmp_path / "cpu.yaml"
    config.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n")
    request = PipelineRequest(script=EXAMPLE, config_file=str(config), model=tiny_gpt2, memory=MemorySettings(device_memory="8GiB"),
                              run_install_test=False)
    preflight(request)
    real = graph_module.environment_fingerprint
    monkeypatch.setattr(graph_module, "environment_fingerprint", lambda: {**real(), "transformers": "99.0.0"})
    graph = graph_module.build_graph(request)
    assert graph.step("memory").status == "would run" and "model libraries" in graph.step("memory").reason
    assert graph.step("config").status == "would use cache"


def test_deepspeed_check_runs_and_reruns_only_when_its_json_changes(tmp_path, tiny_gpt2):
    pytest.importorskip("deepspeed")
    from prefect_accelerate.flows.pipeline import preflight

    ds_json = tmp_path / "ds.json"
    ds_json.write_text('{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1}\n')
    config = tmp_path / "ds.yaml"
    config.write_text(f"distributed_type: DEEPSPEED\nnum_processes: 2\n"
                      f"deepspeed_config:\n  deepspeed_config_file: {ds_json}\n  zero3_init_flag: false\n")
    request = PipelineRequest(script=EXAMPLE, config_file=str(config), model=tiny_gpt2, memory=MemorySettings(device_memory="8GiB"),
                              run_install_test=False, launch_flags={"dynamo_backend": "no"})
    first = statuses(preflight(request))
    first.pop("env")  # the environment report may come from an earlier test's run: same machine
    assert first == {"config": "ran", "memory": "ran", "memory-fit": "ran", "deepspeed-check": "ran", "install-test": "skipped"}
    assert statuses(preflight(request))["deepspeed-check"] == "cached"
    ds_json.write_text(ds_json.read_text().replace('"train_micro_batch_size_per_gpu": 1', '"train_micro_batch_size_per_gpu": 2'))
    third = preflight(request)
    assert statuses(third) == {"config": "cached", "env": "cached", "memory": "cached", "memory-fit": "cached",
                               "deepspeed-check": "ran", "install-test": "skipped"}


def _deepspeed_request(tmp_path, model, content):
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(content)
    config = tmp_path / "ds.yaml"
    config.write_text(f"distributed_type: DEEPSPEED\nnum_processes: 2\n"
                      f"deepspeed_config:\n  deepspeed_config_file: {ds_json}\n  zero3_init_flag: false\n")
    return ds_json, PipelineRequest(script=EXAMPLE, config_file=str(config), model=model,
                                    memory=MemorySettings(device_memory="8GiB"), run_install_test=False,
                                    launch_flags={"dynamo_backend": "no"})


@pytest.mark.parametrize("content", ['{"zero_optimization": "stage 3"}',
                                     '{"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": Infinity}}'])
def test_a_broken_deepspeed_json_is_the_deepspeed_checks_finding_not_a_crash_of_the_graph(tmp_path, tiny_gpt2, content):
    """The graph (and the memory gate's layout) takes DeepSpeed's defaults where the JSON cannot be read; the
    deepspeed-check step then refuses the file, naming it and the field."""
    pytest.importorskip("deepspeed")
    from prefect_accelerate.pipeline.graph import build_graph
    from prefect_accelerate.pipeline.steps import deepspeed_step

    ds_json, request = _deepspeed_request(tmp_path, tiny_gpt2, content)
    assert build_graph(request).step("deepspeed-check") is not None
    with pytest.raises(PreflightError, match="The DeepSpeed check failed: `zero_optimization") as failed:
        deepspeed_step(request)
    assert str(ds_json) in str(failed.value)


def test_a_broken_deepspeed_json_stops_the_real_preflight_at_a_named_step(tmp_path, tiny_gpt2):
    pytest.importorskip("deepspeed")
    from prefect_accelerate.flows.pipeline import preflight

    ds_json, request = _deepspeed_request(tmp_path, tiny_gpt2, '{"zero_optimization": "stage 3"}')
    with pytest.raises(PreflightError, match="Preflight step deepspeed-check failed") as failed:
        preflight(request)
    assert str(ds_json) in str(failed.value) and "Traceback" not in str(failed.value)


def test_an_old_format_config_is_named_in_the_preflight_summary(tmp_path):
    from prefect_accelerate.flows.pipeline import preflight

    config = tmp_path / "old.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nfp16: false\nnum_processes: 2\nuse_cpu: true\n")
    report = preflight(PipelineRequest(script=EXAMPLE, config_file=str(config), run_install_test=False,
                                       launch_flags={"dynamo_backend": "no"}))
    step = next(s for s in report.steps if s.step == "config")
    assert step.status == "ran" and "older format" in step.reason and "config update" in step.reason


def test_a_failed_step_stops_before_the_launch_and_names_the_step(tmp_path):
    from prefect_accelerate.flows.pipeline import launch_training

    config = tmp_path / "bad.yaml"
    config.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_cpu_ram_efficient_loading: true\n  fsdp_sync_module_states: false\n")
    request = PipelineRequest(script=EXAMPLE, config_file=str(config))
    with pytest.raises(PreflightError, match="Preflight step config failed: .*fsdp_sync_module_states.* Nothing was launched"):
        launch_training(request)


def test_memory_gate_stops_a_run_that_would_not_fit(tmp_path, tiny_gpt2):
    from prefect_accelerate.flows.pipeline import run_preflight
    from prefect import flow

    @flow
    def gate():
        request = PipelineRequest(script=EXAMPLE, launch_flags={"cpu": True, "num_processes": 2, **QUIET}, model=tiny_gpt2,
                                  memory=MemorySettings(device_memory="64KiB"))
        return run_preflight(request)

    report = gate()
    assert not report.ok and report.failed_step == "memory-fit"
    assert statuses(report)["install-test"] == "skipped"
    assert report.step("memory-fit").reason.startswith("Does not fit")


def test_pipeline_launches_after_preflight(tmp_path):
    from prefect_accelerate.flows.pipeline import launch_training

    request = PipelineRequest(script=EXAMPLE, launch_flags={"cpu": True, "num_processes": 2, **QUIET}, run_install_test=False)
    result = launch_training(request)
    assert result.launched and result.launch.succeeded
    assert any("all_reduce sum = 3.0" in line for line in result.launch.tail)


def _resume_when_paused(approve: bool, found: dict) -> None:
    from prefect import resume_flow_run
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateName

    async def paused_run():
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(state=FlowRunFilterState(name=FlowRunFilterStateName(any_=["Paused"]))))
            if not runs:
                return None, None
            keyset = runs[0].state.state_details.run_input_keyset or {}
            description = await client.read_flow_run_input(runs[0].id, keyset["description"]) if "description" in keyset else None
            return runs[0].id, description

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        run_id, description = asyncio.run(paused_run())
        if run_id:
            found["id"], found["description"] = run_id, description
            resume_flow_run(run_id, run_input={"approve": approve, "note": "from the test"})
            return
        time.sleep(1)


@pytest.mark.parametrize("approve", [True, False])
def test_approval_gate_launches_only_when_approved(approve):
    from prefect_accelerate.flows.pipeline import launch_training

    found: dict = {}
    helper = threading.Thread(target=_resume_when_paused, args=(approve, found), daemon=True)
    helper.start()
    request = PipelineRequest(script=EXAMPLE, launch_flags={"cpu": True, "num_processes": 2, **QUIET}, run_install_test=False,
                              require_approval=True)
    result = launch_training(request)
    helper.join(timeout=5)
    assert "id" in found
    assert result.launched is approve and result.approved is approve
    # the form the approver sees: the script, every preflight step, and the exact launch plan
    raw = found["description"] or ""
    description = json.loads(raw) if raw.startswith('"') else raw  # stored as a JSON value
    assert "## Approve this launch?" in description and "ddp_allreduce.py" in description
    assert re.search(r"\| config \| (ran|cached) \|", description)
    assert '"argv": [' in description and '"torch.distributed.run"' in description and '"ACCELERATE_USE_CPU": "True"' in description


def test_validate_configs_reports_every_config(tmp_path):
    """The failing case (one bad config among good ones) is tests/flows/test_validate_states.py's."""
    from prefect_accelerate.flows.validate import validate_configs

    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "good.yaml").write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n")
    (folder / "one.yaml").write_text("distributed_type: MULTI_CPU\nnum_processes: 1\nuse_cpu: true\n")
    report = validate_configs(ValidationRequest(configs=[str(folder)], run_install_test=False, max_concurrency=2))
    assert report.ok and [Path(c.config_file).name for c in report.configs] == ["good.yaml", "one.yaml"]


def test_run_names_say_which_launcher_runs(monkeypatch, hf_home):
    from prefect.runtime import flow_run

    from prefect_accelerate.flows.pipeline import _run_name

    def name_for(request: PipelineRequest) -> str:
        monkeypatch.setitem(flow_run.FIELDS, "parameters", lambda: {"request": request})
        return _run_name("launch-training")()

    # `--cpu` with no config file anywhere: the name says no file was read (not "default-config")
    assert name_for(PipelineRequest(script=EXAMPLE, launch_flags={"cpu": True, "num_processes": 2, **QUIET})) == \
        "launch-training-torchrun-cpu-no-config-file-ddp_allreduce-2p"
    deepspeed = PipelineRequest(script=EXAMPLE, launch_flags={"use_deepspeed": True, "zero_stage": 2, "num_processes": 2, **QUIET})
    assert name_for(deepspeed) == "launch-training-deepspeed-no-config-file-ddp_allreduce-2p"
    # options that do not resolve leave the launcher out instead of failing the run (the config step reports them)
    assert name_for(PipelineRequest(script=EXAMPLE, config_file="/no/such.yaml")) == "launch-training-such.yaml-ddp_allreduce"
    assert name_for(PipelineRequest(script=EXAMPLE, config_file="/no/such.yaml", model="/models/tiny-gpt2/")) == \
        "launch-training-such.yaml-ddp_allreduce-tiny-gpt2"
