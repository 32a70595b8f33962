"""The DeepSpeed preflight check: DeepSpeed itself, its accelerator and backend, and ZeRO model-state memory."""

from __future__ import annotations

import subprocess
import sys

import pytest

from prefect_accelerate.launchers.engines.deepspeed import check as check_module
from prefect_accelerate.launchers.engines.deepspeed.check import DeepSpeedCheck, check_deepspeed, estimate_zero_memory, settings_from_options
from prefect_accelerate.launchers.host import StaticHost
from prefect_accelerate.launchers.options import build_launch_options


def test_the_check_imports_neither_prefect_nor_deepspeed_until_called():
    code = ("import sys, prefect_accelerate.launchers.engines.deepspeed.check as c; "
            "print(sorted(m for m in ('prefect', 'deepspeed', 'torch') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stderr


def test_missing_deepspeed_is_reported_not_raised(monkeypatch):
    monkeypatch.setattr(check_module, "installed_deepspeed_version", lambda: None)
    result = check_deepspeed(total_params=1000)
    assert isinstance(result, DeepSpeedCheck)
    assert not result.ok and not result.installed
    assert "pip install 'prefect-accelerate[deepspeed]'" in result.problems[0]


class TestWithDeepSpeed:
    @pytest.fixture(autouse=True)
    def _needs_deepspeed(self):
        pytest.importorskip("deepspeed")

    @pytest.fixture
    def model(self):
        import torch

        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))

    def test_accelerator_backend_and_version_come_from_deepspeed(self):
        from importlib import metadata

        from deepspeed.accelerator import get_accelerator

        result = check_deepspeed()
        assert result.ok and result.installed and result.version == metadata.version("deepspeed")
        assert (result.accelerator, result.communication_backend) == (get_accelerator().device_name(), get_accelerator().communication_backend_name())
        assert result.memory is None

    def test_zero2_memory_equals_deepspeeds_estimator_for_the_model(self, model):
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs, model_to_params

        result = check_deepspeed(model, zero_stage=2, gpus_per_node=4, num_nodes=2, offload_optimizer_device="cpu")
        cpu, gpu = estimate_zero2_model_states_mem_needs(model_to_params(model), 4, 2, cpu_offload=True)
        assert result.memory.total_params == model_to_params(model) == 64 * 256 + 256 + 256 * 8 + 8
        assert (result.memory.per_node_cpu_bytes, result.memory.per_device_bytes) == (cpu, gpu)
        assert result.memory.offload_optimizer and len(result.memory.options) == 2

    def test_zero3_memory_equals_deepspeeds_estimator_and_table(self, model):
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params

        total, largest = model_to_params(model)
        result = check_deepspeed(model, zero_stage=3, gpus_per_node=8, num_nodes=2, zero3_init=False)
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, 8, 2, cpu_offload=False, cpu_offload_params=False, zero_init=False)
        assert (result.memory.largest_layer_params, result.memory.per_device_bytes, result.memory.per_node_cpu_bytes) == (largest, gpu, int(cpu))
        assert len(result.memory.options) == 6  # the rows of DeepSpeed's own table

    def test_parameter_counts_work_without_a_model(self):
        estimate = estimate_zero_memory(7_000_000_000, zero_stage=2, gpus_per_node=8, num_nodes=2, offload_optimizer_device="none")
        assert (estimate.per_node_cpu_bytes, estimate.per_device_bytes) == (336_000_000_000, 21_875_000_000)
        with pytest.raises(ValueError, match="largest layer"):
            estimate_zero_memory(10, zero_stage=3)

    def test_stage_one_has_no_deepspeed_estimator_and_says_where_to_look(self, model):
        result = check_deepspeed(model, zero_stage=1)
        assert result.ok and result.memory is None
        assert any("no memory estimator for ZeRO stage 1" in note for note in result.notes)

    def test_states_larger_than_the_device_are_a_problem_with_a_way_out(self, model):
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs, model_to_params

        _, offloaded = estimate_zero2_model_states_mem_needs(model_to_params(model), 1, 1, cpu_offload=True)
        result = check_deepspeed(model, zero_stage=2, device_memory_bytes=offloaded)
        assert not result.ok
        assert "An offload setting that fits: offload_optimizer=cpu." in result.problems[0]

    def test_settings_come_from_launch_options_and_the_json_file_wins(self, tmp_path):
        (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}')
        host = StaticHost(kind="cuda", count=8)
        options = build_launch_options("train.py", host=host, use_deepspeed=True, num_processes=16, num_machines=2,
                                       zero_stage=2, zero3_init_flag="false", deepspeed_config_file="ds.json")
        settings = settings_from_options(options, cwd=str(tmp_path))
        assert settings == {"zero_stage": 3, "gpus_per_node": 8, "num_nodes": 2, "offload_optimizer_device": None,
                            "offload_param_device": "cpu", "zero3_init": False}
        assert check_deepspeed(total_params=10_000, largest_layer_params=1_000, **settings).memory.offload_param
