"""The CUDA attention and dropout kernels stood in for during the trace (memory/attention.py)."""

from __future__ import annotations

import pytest

from prefect_accelerate.memory import EstimateOptions, estimate
from prefect_accelerate.memory.attention import cuda_sdpa_kernel


def _qkv(dtype: str, heads: int = 8, kv_heads: int = 8, head_dim: int = 64):
    import torch

    q = torch.empty(1, heads, 4, head_dim, dtype=getattr(torch, dtype), device="meta")
    k = torch.empty(1, kv_heads, 4, head_dim, dtype=getattr(torch, dtype), device="meta")
    return q, k, k.clone()


@pytest.mark.parametrize(("dtype", "kv_heads", "mask", "gqa", "head_dim", "kernel"), [
    ("bfloat16", 8, False, False, 64, "flash"),
    ("float16", 2, False, True, 128, "flash"),       # flash takes grouped keys/values
    ("bfloat16", 8, True, False, 64, "efficient"),   # a mask rules flash out
    ("float32", 8, False, False, 64, "efficient"),   # flash has no fp32
    ("float32", 2, False, True, 64, "math"),         # fp32 + GQA: no fused kernel takes it (Llama fp32, torch 2.11)
    ("bfloat16", 2, True, True, 64, "math"),         # a mask and grouped heads
    ("bfloat16", 8, False, False, 512, "efficient"),  # head dim past flash's 256
    ("bfloat16", 8, False, False, 100, "flash"),     # not a multiple of 8: padded for flash
    ("bfloat16", 8, True, False, 100, "math"),       # ... but memory-efficient needs a multiple of 8 in 16-bit
    ("float32", 8, True, False, 100, "efficient"),   # ... and a multiple of 4 in fp32
])
def test_cuda_picks_the_first_backend_whose_constraints_hold(dtype, kv_heads, mask, gqa, head_dim, kernel):
    import torch

    q, k, v = _qkv(dtype, kv_heads=kv_heads, head_dim=head_dim)
    attn_mask = torch.zeros(1, 1, 4, 4, device="meta", dtype=q.dtype) if mask else None
    assert cuda_sdpa_kernel(q, k, attn_mask, enable_gqa=gqa, v=v) == kernel


def test_flash_attention_2_is_flash_whatever_the_inputs():
    q, k, v = _qkv("float32", kv_heads=2)
    assert cuda_sdpa_kernel(q, k, None, enable_gqa=True, force_flash=True, v=v) == "flash"


def _acts(folder, **options):
    options.setdefault("strategy", "ddp")
    return estimate(str(folder), EstimateOptions(dtypes=("float32",), **options)).profile.activations


def test_cuda_dropout_keeps_a_one_byte_mask_where_cpu_keeps_float_noise(zoo):
    # tiny-gpt2 in eager: every dropout (attention, residual, MLP, embeddings) is F.dropout
    cuda = _acts(zoo["tiny-gpt2"], seq_len=64, batch_size=2, attn_implementation="eager")
    cpu = _acts(zoo["tiny-gpt2"], seq_len=64, batch_size=2, attn_implementation="eager", device_type="cpu")
    assert cuda.attention_kernels == [] and cuda.attention_implementation == "eager"
    assert cuda.saved_bytes < cpu.saved_bytes


def test_fused_kernels_keep_no_seq_by_seq_matrix_and_math_does(zoo):
    def per_token(seq: int, **options) -> float:
        acts = _acts(zoo["tiny-llama"], seq_len=seq, batch_size=1, **options)
        return acts.saved_bytes / seq

    # bf16 weights under DeepSpeed-style precision: flash; saved bytes per token do not grow with the sequence
    flash = [per_token(s, mixed_precision="bf16", strategy="zero2", num_processes=2) for s in (64, 256)]
    math = [per_token(s) for s in (64, 256)]  # fp32 with grouped kv heads: math
    assert flash[1] == pytest.approx(flash[0], rel=0.02)
    # math keeps fp32 probabilities: heads x seq x 4 bytes per token and layer (tiny-llama: 4 heads, 10 layers)
    assert math[1] - math[0] == pytest.approx(4 * (256 - 64) * 4 * 10, rel=0.01)


def test_the_trace_records_the_kernel_and_the_implementation(zoo):
    acts = _acts(zoo["tiny-llama"], seq_len=32)
    assert acts.attention_implementation == "sdpa" and acts.attention_kernels == ["math"]
    cpu = _acts(zoo["tiny-llama"], seq_len=32, device_type="cpu")
    assert cpu.attention_kernels == []


def test_torch_is_left_as_it_was_after_a_trace(zoo):
    import torch.nn.functional as F  # noqa: N812

    before = (F.scaled_dot_product_attention, F.dropout)
    _acts(zoo["tiny-gpt2"], seq_len=16)
    assert (F.scaled_dot_product_attention, F.dropout) == before


def test_a_head_dim_of_100_runs_flash_padded_to_104_in_bf16(tmp_path):
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=200, intermediate_size=256, num_attention_heads=2,
                                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=128,
                                      architectures=["LlamaForCausalLM"], bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config.save_pretrained(tmp_path)
    acts = _acts(tmp_path, seq_len=64, mixed_precision="bf16", strategy="zero2", num_processes=2)
    assert acts.attention_kernels == ["flash"]
    assert "head dim 100 padded to 104" in acts.attention_detail
    on_volta = _acts(tmp_path, seq_len=64, mixed_precision="bf16", strategy="zero2", num_processes=2, cuda_capability="7.0")
    assert on_volta.attention_kernels == ["math"]  # no flash before sm80, bf16 has no memory-efficient kernel there


def test_t5s_learned_position_bias_counts_its_gradient_in_backward_with_memory_efficient(zoo):
    acts = _acts(zoo["tiny-t5"], seq_len=32, batch_size=2)
    assert "efficient" in acts.attention_kernels
    # the (B, H, L, S rounded to 16) fp32 gradient of the bias: 2 x 2 heads x 32 x 32 x 4 bytes
    assert acts.attention_backward_bytes == 2 * 2 * 32 * 32 * 4
    est = estimate(str(zoo["tiny-t5"]), EstimateOptions(dtypes=("float32",), strategy="ddp", seq_len=32, batch_size=2))
    assert "mask's gradient" in est.breakdown.item("backward_temporaries").formula


def test_flash_attention_2_on_a_class_transformers_refuses_it_for_is_an_error_not_an_estimate(zoo):
    from prefect_accelerate.errors import EstimateError

    # T5 adds a learned position bias to the scores: transformers marks it `_supports_flash_attn = False`
    with pytest.raises(EstimateError, match="T5ForConditionalGeneration.*does not support flash_attention_2"):
        _acts(zoo["tiny-t5"], seq_len=16, attn_implementation="flash_attention_2")
    assert _acts(zoo["tiny-llama"], seq_len=16, attn_implementation="flash_attention_2").attention_kernels == ["flash"]
