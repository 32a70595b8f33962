"""CUDA's autocast policy in place of CPU's while the trace stands for a GPU (memory/autocast_rules.py)."""

from __future__ import annotations

import threading

import pytest

from prefect_accelerate.memory import EstimateOptions, estimate
from prefect_accelerate.memory.autocast_rules import POLICIES, cuda_policy, installed_autocast_ops


def _existing_ops() -> set[str]:
    import torch

    return {name.removeprefix("aten::") for name in torch._C._dispatch_get_all_op_names() if name.startswith("aten::")}


def test_every_op_the_installed_torch_autocasts_on_cuda_has_a_transcribed_policy():
    cuda, _ = installed_autocast_ops()
    assert len(cuda) > 100
    assert sorted(cuda - set(POLICIES)) == []


def test_every_transcribed_op_that_this_torch_has_is_one_it_autocasts_on_cuda():
    cuda, _ = installed_autocast_ops()
    present = set(POLICIES) & _existing_ops()
    assert sorted(present - cuda) == []
    # the redispatch targets of fp32_append_dtype exist
    assert {"norm.ScalarOpt_dtype", "norm.ScalarOpt_dim_dtype"} <= _existing_ops()


def _bf16(*shape, grad=True):
    import torch

    return torch.randn(*shape, dtype=torch.bfloat16, requires_grad=grad)


def test_under_the_cuda_policy_fp32_ops_upcast_and_matmuls_downcast_and_autograd_keeps_the_cast():
    import torch
    import torch.nn.functional as F  # noqa: N812

    x = _bf16(4, 8)
    weight = torch.randn(8, 8, requires_grad=True)
    with cuda_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        powered = torch.pow(x, 3.0)
        assert powered.dtype == torch.float32
        assert type(powered.grad_fn.next_functions[0][0]).__name__ == "ToCopyBackward0"  # the cast is in the graph
        assert torch.softmax(x, -1).dtype == torch.float32  # fp32_set_opt_dtype
        assert x.sum().dtype == torch.float32
        assert torch.softmax(x, -1, dtype=torch.bfloat16).dtype == torch.bfloat16  # an explicit dtype is kept
        assert F.layer_norm(x, (8,)).dtype == torch.float32
        assert torch.rsqrt(x.abs() + 1).dtype == torch.float32
        assert torch.norm(x).dtype == torch.float32  # fp32_append_dtype
        assert F.linear(torch.randn(4, 8), weight).dtype == torch.bfloat16
        assert torch.addcmul(torch.randn(4, 8), x, x).dtype == torch.float32  # promote: fp32 wins
        # reflection padding: fp32 under CPU's autocast, not listed for CUDA: it stays in its input's dtype
        assert F.pad(x.reshape(1, 4, 8), (1, 1), mode="reflect").dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(torch.rand(4, requires_grad=True), torch.rand(4))


def _saved_by_cross_entropy(policy) -> dict[str, object]:
    import torch
    import torch.nn.functional as F  # noqa: N812

    logits = _bf16(6, 10)
    with policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(logits, torch.zeros(6, dtype=torch.long))
    nll = loss.grad_fn
    log_softmax = nll.next_functions[0][0]
    while not hasattr(log_softmax, "_saved_result"):
        log_softmax = log_softmax.next_functions[0][0]
    return {"log_softmax keeps": log_softmax._saved_result.dtype, "nll_loss keeps": nll._saved_self.dtype}


def test_an_op_only_cpu_lists_falls_through_so_the_ops_it_is_made_of_still_meet_cudas_policy():
    """cross_entropy_loss has a CPU autocast kernel (fp32) and none on CUDA. There its composite calls
    log_softmax with an explicit dtype, the logits' own, which fp32_set_opt_dtype respects, and nll_loss
    (fp32) then keeps an fp32 copy of the 16-bit log-probabilities: both are kept for backward."""
    import contextlib

    import torch

    assert _saved_by_cross_entropy(cuda_policy) == {"log_softmax keeps": torch.bfloat16, "nll_loss keeps": torch.float32}
    assert _saved_by_cross_entropy(contextlib.nullcontext) == {"log_softmax keeps": torch.float32, "nll_loss keeps": torch.float32}


def test_cpus_own_policy_is_back_after_the_trace():
    import torch
    import torch.nn.functional as F  # noqa: N812

    x = _bf16(4, 8)
    with cuda_policy():
        pass
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.pow(x, 3.0).dtype == torch.bfloat16
        assert F.pad(x.reshape(1, 4, 8), (1, 1), mode="reflect").dtype == torch.float32


def test_a_weight_is_cast_once_however_often_it_is_used_as_cudas_cast_cache_does():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    weight = torch.randn(8, 8, requires_grad=True)
    casts = []

    class CountCasts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if func is torch.ops.aten._to_copy.default and args[0] is weight:
                casts.append(func)
            return func(*args, **(kwargs or {}))

    with cuda_policy(), torch.autocast("cpu", dtype=torch.bfloat16), CountCasts():
        x = torch.randn(2, 8)
        for _ in range(3):
            x = torch.nn.functional.linear(x, weight).float()
    assert len(casts) == 1


def test_another_thread_using_cpu_autocast_meanwhile_runs_in_the_widest_dtype_without_errors():
    import torch
    import torch.nn.functional as F  # noqa: N812

    seen: dict[str, object] = {}

    def other() -> None:
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                seen["linear"] = F.linear(_bf16(2, 8, grad=False), torch.randn(8, 8)).dtype
                seen["pow"] = torch.pow(_bf16(2, 8, grad=False), 2.0).dtype
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            seen["error"] = error

    with cuda_policy():
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert "error" not in seen, seen
    assert seen == {"linear": torch.float32, "pow": torch.bfloat16}


def test_gpt2s_tanh_gelu_keeps_its_mlp_intermediates_in_fp32_on_a_gpu(zoo, monkeypatch):
    """NewGELU: pow(x, 3) is an fp32 op on CUDA, so the chain after it runs in fp32 and c_proj's input is
    cast back: 6 more bytes per MLP element than under CPU's policy (x in fp32 for pow, tanh's output and
    1 + tanh in fp32 instead of bf16, and the bf16 copy c_proj keeps)."""
    import contextlib

    from prefect_accelerate.memory import autocast_rules

    options = EstimateOptions(strategy="ddp", mixed_precision="bf16", batch_size=2, seq_len=64)
    with_cuda_rules = estimate(str(zoo["tiny-gpt2"]), options).profile.activations
    monkeypatch.setattr(autocast_rules, "cuda_policy", contextlib.nullcontext)
    with_cpu_rules = estimate(str(zoo["tiny-gpt2"]), options).profile.activations
    layers, batch, seq, inner = 2, 2, 64, 4 * 64
    assert with_cuda_rules.saved_bytes - with_cpu_rules.saved_bytes == layers * batch * seq * inner * 6


def test_fp32_training_is_not_touched_by_the_policy(zoo, monkeypatch):
    import contextlib

    from prefect_accelerate.memory import autocast_rules

    options = EstimateOptions(strategy="ddp", batch_size=2, seq_len=64)
    before = estimate(str(zoo["tiny-gpt2"]), options).breakdown.device_total_bytes
    monkeypatch.setattr(autocast_rules, "cuda_policy", contextlib.nullcontext)
    assert estimate(str(zoo["tiny-gpt2"]), options).breakdown.device_total_bytes == before


def test_an_op_cuda_autocasts_by_a_policy_we_have_not_transcribed_runs_in_fp32_and_the_estimate_names_it(zoo, monkeypatch):
    """A newer torch may add an op to CUDA's lists: it is traced in fp32 (keeps the most) and named, and the
    fit verdict counts it as an unmodelled path (wider margin)."""
    from prefect_accelerate.memory import autocast_rules
    from prefect_accelerate.memory.fit import unmodelled_paths

    policies = {name: policy for name, policy in POLICIES.items() if name != "pow.Tensor_Scalar"}
    monkeypatch.setattr(autocast_rules, "POLICIES", policies)
    est = estimate(str(zoo["tiny-gpt2"]), EstimateOptions(strategy="ddp", mixed_precision="bf16", batch_size=2, seq_len=64))
    detail = est.profile.activations.attention_detail
    assert "CUDA autocast policy not transcribed for: pow.Tensor_Scalar (run in fp32)" in detail
    assert any("autocast" in path for path in unmodelled_paths(est))
    # traced in fp32, as the real policy would: the same bytes as with it
    monkeypatch.setattr(autocast_rules, "POLICIES", POLICIES)
    known = estimate(str(zoo["tiny-gpt2"]), EstimateOptions(strategy="ddp", mixed_precision="bf16", batch_size=2, seq_len=64))
    assert est.profile.activations.saved_bytes == known.profile.activations.saved_bytes
    assert unmodelled_paths(known) == []
