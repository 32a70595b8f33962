"""FSDP, MULTI_GPU and Megatron-LM configs run for real on this CPU host: our torchrun path starts two gloo
workers with each mode's environment, and the bundled self-test checks them (Accelerator() included)."""

from __future__ import annotations

import subprocess
from pathlib import Path
import sys

import pytest

pytestmark = pytest.mark.slow
CLI = [str(Path(sys.executable).with_name("prefect-accelerate")), "test", "--no-track"]
BASE = "compute_environment: LOCAL_MACHINE\nmixed_precision: 'no'\nnum_machines: 1\nnum_processes: 2\n"
CONFIGS = {
    "fsdp2": BASE + "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_auto_wrap_policy: NO_WRAP\n"
                    "  fsdp_state_dict_type: SHARDED_STATE_DICT\n  fsdp_reshard_after_forward: true\n",
    "multi_gpu": BASE + "distributed_type: MULTI_GPU\n",
}


@pytest.mark.parametrize("mode", sorted(CONFIGS))
def test_mode_runs_two_workers_that_pass_the_self_test(mode, tmp_path):
    config = tmp_path / f"{mode}.yaml"
    config.write_text(CONFIGS[mode])
    done = subprocess.run([*CLI, "--config_file", str(config)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Accelerate 1.16 on a CPU host runs these as MULTI_CPU; its own launcher would give each worker "NO, 1"
    assert "PASS accelerator: Accelerator(): MULTI_CPU, 2 process(es)" in done.stdout
    assert "SUCCESS Test is a success!" in done.stdout


def test_megatron_config_reaches_the_workers(tmp_path):
    """Megatron-LM is not installed here: the workers' Accelerator() asks for it, which shows the
    MEGATRON_LM environment arrived, and the failure names the check, the ranks and exits non-zero."""
    config = tmp_path / "megatron.yaml"
    config.write_text(BASE + "distributed_type: MEGATRON_LM\nmegatron_lm_config:\n  megatron_lm_tp_degree: 1\n  megatron_lm_pp_degree: 1\n")
    done = subprocess.run([*CLI, "--config_file", str(config)], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "check accelerator on rank(s) [0, 1]" in done.stderr and "Megatron is not installed" in done.stderr
    assert "PASS training-steps" in done.stdout  # everything before the Accelerator() check passed
