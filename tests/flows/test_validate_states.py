"""`validate` (issue 17 item 13): a failed check is a Failed task run, no Prefect traceback precedes the one
error paragraph, a device config that passed on a CPU machine says so, a known failure names cause and fix."""

from __future__ import annotations

import asyncio

import pytest

from prefect_accelerate.errors import PreflightError
from prefect_accelerate.launchers.host import StaticHost
from prefect_accelerate.pipeline.models import ValidationRequest
from prefect_accelerate.pipeline.validate import config_note

CPU_ONLY = StaticHost(kind=None, count=0, cores=4)
GPUS = StaticHost(kind="cuda", count=8, cores=32)


def test_a_multi_gpu_config_that_passed_on_a_cpu_machine_says_it_was_checked_on_cpu_only(tmp_path):
    config = tmp_path / "mg.yaml"
    config.write_text("distributed_type: MULTI_GPU\nnum_processes: 8\n")
    note = config_note(str(config), ok=True, failed_step=None, host=CPU_ONLY)
    assert note.startswith("Checked on CPU only") and "MULTI_GPU" in note
    assert config_note(str(config), ok=True, failed_step=None, host=GPUS) == ""


def test_deepspeed_with_use_cpu_failing_the_self_test_gets_its_cause_and_fix(tmp_path):
    config = tmp_path / "ds.yaml"
    config.write_text("distributed_type: DEEPSPEED\nnum_processes: 2\nuse_cpu: true\ndeepspeed_config:\n  zero_stage: 2\n")
    note = config_note(str(config), ok=False, failed_step="install-test", host=CPU_ONLY)
    assert "Cause: use_cpu: true turns DeepSpeed off" in note and "Fix: set use_cpu: false" in note


@pytest.mark.usefixtures("prefect_harness")
def test_a_failed_check_is_a_failed_task_run_and_no_traceback_is_printed(tmp_path, capfd):
    from prefect.client.orchestration import get_client

    from prefect_accelerate.flows.validate import validate_configs

    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: MULTI_CPU\nnum_processes: two\n")
    (tmp_path / "good.yaml").write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n")
    capfd.readouterr()
    state = validate_configs(request=ValidationRequest(configs=[str(tmp_path)], run_install_test=False), return_state=True)
    printed = capfd.readouterr()
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, PreflightError) and "1 of 2 config(s) failed validation: bad.yaml (config" in error.message
    assert "Traceback" not in printed.out + printed.err

    async def task_states() -> dict[str, str]:
        async with get_client() as client:
            runs = await client.read_task_runs()
            return {r.name: r.state.type.value for r in runs if r.flow_run_id == state.state_details.flow_run_id and r.name.startswith("validate-")}

    assert asyncio.run(task_states()) == {"validate-bad.yaml": "FAILED", "validate-good.yaml": "COMPLETED"}
    with pytest.raises(PreflightError, match="1 of 2 config"):  # what a Python caller of the flow gets raised
        state.result()
