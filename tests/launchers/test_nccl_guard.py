"""The RTX 4000 guard (NCCL P2P/IB off for several RTX 40xx cards on drivers before 550.40.07), decided as
Accelerate 1.16.0's check_cuda_p2p_ib_support decides it, on described hosts (no GPU here)."""

from __future__ import annotations

import pytest

from prefect_accelerate.launchers.environment import nccl_guard_env
from prefect_accelerate.launchers.host import StaticHost

accelerate_env = pytest.importorskip("accelerate.utils.environment")

CASES = {
    "two-4090-old-driver": ([("NVIDIA GeForce RTX 4090", "535.104.05")] * 2, True),
    "two-4090-new-driver": ([("NVIDIA GeForce RTX 4090", "550.54.14")] * 2, False),
    "two-4090-exact-driver": ([("NVIDIA GeForce RTX 4090", "550.40.07")] * 2, False),
    "one-4090-old-driver": ([("NVIDIA GeForce RTX 4090", "535.104.05")], False),
    "two-a100-old-driver": ([("NVIDIA A100-SXM4-80GB", "535.104.05")] * 2, False),
    "mixed-3090-4080-old-driver": ([("NVIDIA GeForce RTX 3090", "535.54.03"), ("NVIDIA GeForce RTX 4080", "535.54.03")], True),
}


def accelerate_says_unsupported(gpus, monkeypatch) -> bool:
    monkeypatch.setattr(accelerate_env, "get_gpu_info", lambda: ([name for name, _ in gpus], len(gpus)))
    monkeypatch.setattr(accelerate_env, "get_driver_version", lambda: gpus[0][1])
    return not accelerate_env.check_cuda_p2p_ib_support()


@pytest.mark.parametrize("name", sorted(CASES))
def test_guard_matches_accelerates_check(name, monkeypatch):
    gpus, expected = CASES[name]
    assert accelerate_says_unsupported(gpus, monkeypatch) is expected
    env, warning = nccl_guard_env(StaticHost(kind="cuda", count=len(gpus), gpus=gpus), {})
    if expected:
        assert env == {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"} and "RTX 4000" in warning
    else:
        assert env == {} and warning is None


def test_a_choice_the_user_already_made_is_kept():
    gpus = [("NVIDIA GeForce RTX 4090", "535.104.05")] * 2
    env, warning = nccl_guard_env(StaticHost(kind="cuda", count=2, gpus=gpus), {"NCCL_P2P_DISABLE": "0"})
    assert env == {"NCCL_IB_DISABLE": "1"} and warning  # only the variable not set yet, as Accelerate
    assert nccl_guard_env(StaticHost(kind="cuda", count=2, gpus=gpus), {"NCCL_P2P_DISABLE": "0", "NCCL_IB_DISABLE": "0"}) == ({}, None)
