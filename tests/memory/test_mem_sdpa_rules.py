"""One test per dispatcher rule transcribed in memory/sdpa_rules.py (PyTorch's sdp_utils.cpp / sdp_utils_cpp.h).

Pure Python: no torch, no model. Each test changes one input of a call that otherwise takes the first
backend, and checks the backend that the rule then sends it to.
"""

from __future__ import annotations

import dataclasses

import pytest

from prefect_accelerate.memory.sdpa_rules import (
    CUDNN,
    EFFICIENT,
    FLASH,
    MATH,
    CudaTarget,
    MaskInfo,
    SdpaCall,
    minimum_gemm_alignment,
    padded_head_dim,
    select_sdp_backend,
    torch_release,
)

H100 = CudaTarget(capability=(9, 0), torch=(2, 11))
BF16 = SdpaCall(dtype="bfloat16", batch=2, q_heads=8, kv_heads=8, q_len=128, kv_len=128, head_dim=64)
FP32 = dataclasses.replace(BF16, dtype="float32")


def pick(call: SdpaCall, target: CudaTarget = H100) -> str:
    return select_sdp_backend(call, target).backend


def with_(call: SdpaCall, **change) -> SdpaCall:
    return dataclasses.replace(call, **change)


def test_bf16_without_mask_is_flash_on_sm90():
    assert pick(BF16) == FLASH


def test_check_runtime_disabled_flash_sends_the_call_to_memory_efficient():
    target = dataclasses.replace(H100, enabled=frozenset({EFFICIENT, CUDNN, MATH}))
    assert pick(BF16, target) == EFFICIENT


def test_check_runtime_disabled_everything_but_math_is_math():
    assert pick(BF16, dataclasses.replace(H100, enabled=frozenset({MATH}))) == MATH


def test_no_backend_enabled_is_an_error_as_in_pytorch():
    with pytest.raises(ValueError, match="No available SDPA kernel"):
        select_sdp_backend(BF16, dataclasses.replace(H100, enabled=frozenset()))


def test_check_tensor_shapes_three_dimensional_inputs_are_math():
    assert pick(with_(BF16, ndim=3)) == MATH


def test_check_for_attn_mask_any_mask_rules_flash_out():
    mask = MaskInfo(dtype="bool", shape=(2, 1, 128, 128))
    assert pick(with_(BF16, mask=mask)) == EFFICIENT


def test_check_head_dim_size_flash_takes_a_head_dim_that_is_not_a_multiple_of_8():
    assert pick(with_(BF16, head_dim=100)) == FLASH
    assert padded_head_dim(100) == 104 and padded_head_dim(128) == 128


def test_check_head_dim_size_flash_refuses_more_than_256():
    assert pick(with_(BF16, head_dim=264)) == EFFICIENT


def test_check_head_dim_size_flash_refuses_different_value_head_dim():
    assert pick(with_(BF16, value_dim=128)) == EFFICIENT


def test_check_flash_attention_hardware_support_needs_sm80():
    assert pick(with_(BF16, dtype="float16"), dataclasses.replace(H100, capability=(7, 5))) == EFFICIENT


def test_check_requires_grad_and_head_dim_gt192_on_sm86_refuses_training_with_head_dim_200():
    sm86 = dataclasses.replace(H100, capability=(8, 6))
    assert pick(with_(BF16, head_dim=200), sm86) == EFFICIENT
    assert pick(with_(BF16, head_dim=200, requires_grad=False), sm86) == FLASH  # inference is fine
    assert pick(with_(BF16, head_dim=200), H100) == FLASH  # sm90 is fine
    assert pick(with_(BF16, head_dim=232), sm86) == FLASH  # above 224 without dropout
    assert pick(with_(BF16, head_dim=232, dropout=0.1), sm86) == EFFICIENT


def test_check_flash_causal_non_square_seqlens_refuses_causal_with_different_lengths():
    assert pick(with_(BF16, is_causal=True, kv_len=256)) == EFFICIENT
    assert pick(with_(BF16, is_causal=True)) == FLASH


def test_check_dtypes_flash_attention_refuses_fp32_and_bf16_before_sm80():
    assert pick(FP32) == EFFICIENT
    assert pick(BF16, dataclasses.replace(H100, capability=(7, 5))) == MATH  # bf16 on sm75: no fused kernel


def test_check_batch_size_and_num_heads_dense_flash_takes_gqa_only_with_enable_gqa():
    assert pick(with_(BF16, kv_heads=2, enable_gqa=True)) == FLASH
    assert pick(with_(BF16, kv_heads=2, enable_gqa=False)) == MATH
    assert pick(with_(BF16, kv_heads=3, enable_gqa=True)) == MATH  # 8 heads are not groups of 3


def test_memory_efficient_takes_gqa_only_from_the_release_that_added_it():
    fp32_gqa = with_(FP32, kv_heads=2, enable_gqa=True)
    assert pick(fp32_gqa, H100) == MATH
    assert pick(fp32_gqa, dataclasses.replace(H100, torch=(2, 14))) == EFFICIENT


def test_check_nonzero_sequence_lengths_dense_zero_length_is_math():
    assert pick(with_(BF16, q_len=0)) == MATH


def test_check_last_dim_stride_equals_1_dense_a_permuted_mask_sends_memory_efficient_to_math():
    contiguous = MaskInfo(dtype="float32", shape=(1, 8, 128, 128), last_stride=1, requires_grad=True)
    permuted = dataclasses.replace(contiguous, last_stride=8)  # T5's bias: permute([2, 0, 1]) of (L, S, H)
    assert pick(with_(FP32, mask=contiguous)) == EFFICIENT
    assert pick(with_(FP32, mask=permuted)) == MATH
    assert pick(with_(FP32, last_strides_one=False)) == MATH


def test_check_mem_efficient_hardware_support_needs_sm50():
    assert pick(FP32, dataclasses.replace(H100, capability=(3, 7))) == MATH


def test_minimum_gemm_alignment_is_8_for_16_bit_and_4_for_fp32_on_sm80():
    assert minimum_gemm_alignment(BF16, H100) == 8
    assert minimum_gemm_alignment(FP32, H100) == 4
    assert minimum_gemm_alignment(FP32, dataclasses.replace(H100, capability=(7, 0))) == 1


def test_check_head_dim_size_mem_efficient_needs_the_gemm_alignment():
    masked = MaskInfo(dtype="bfloat16", shape=(2, 1, 128, 128))
    assert pick(with_(BF16, head_dim=100, mask=masked)) == MATH  # 100 % 8
    assert pick(with_(FP32, head_dim=100, mask=dataclasses.replace(masked, dtype="float32"))) == EFFICIENT  # 100 % 4
    assert pick(with_(FP32, head_dim=102)) == MATH


def test_memory_efficient_accepts_a_mask_that_requires_grad():
    bias = MaskInfo(dtype="float32", shape=(1, 8, 128, 128), requires_grad=True)
    assert pick(with_(FP32, mask=bias)) == EFFICIENT


def test_check_dtypes_mem_efficient_refuses_bf16_before_sm80():
    assert pick(with_(BF16, mask=MaskInfo(dtype="bool", shape=(128, 128))), dataclasses.replace(H100, capability=(7, 5))) == MATH


def test_cudnn_is_reached_only_where_preferred_because_math_comes_before_it():
    masked = with_(BF16, mask=MaskInfo(dtype="bool", shape=(2, 1, 128, 128)))
    assert pick(masked) == EFFICIENT
    assert pick(masked, dataclasses.replace(H100, prefer_cudnn=True)) == CUDNN


def test_check_attn_mask_shape_cudnn_refuses_a_mask_that_requires_grad():
    preferred = dataclasses.replace(H100, prefer_cudnn=True)
    bias = MaskInfo(dtype="bfloat16", shape=(1, 8, 128, 128), requires_grad=True)
    assert pick(with_(BF16, mask=bias), preferred) == EFFICIENT
    assert pick(with_(BF16, mask=dataclasses.replace(bias, requires_grad=False)), preferred) == CUDNN
    assert pick(with_(BF16, mask=dataclasses.replace(bias, shape=(3, 8, 128, 128), requires_grad=False)), preferred) == EFFICIENT


def test_check_cudnn_tensor_shapes_refuses_head_dims_that_are_not_multiples_of_8():
    preferred = dataclasses.replace(H100, prefer_cudnn=True)
    assert pick(BF16, preferred) == CUDNN
    assert pick(with_(BF16, head_dim=100), preferred) == FLASH


def test_check_cudnn_dropout_needs_sixteenths():
    preferred = dataclasses.replace(H100, prefer_cudnn=True)
    assert pick(with_(BF16, dropout=0.125), preferred) == CUDNN
    assert pick(with_(BF16, dropout=0.1), preferred) == FLASH


def test_every_refused_backend_is_explained_with_its_first_failed_rule():
    choice = select_sdp_backend(with_(FP32, kv_heads=2, enable_gqa=True), H100)
    assert choice.backend == MATH and set(choice.refused) == {FLASH, EFFICIENT}
    assert "float32" in choice.refused[FLASH] and "GQA" in choice.refused[EFFICIENT]


def test_torch_release_reads_local_version_suffixes():
    assert torch_release("2.13.0+cpu") == (2, 13) and torch_release("2.11.0+cu130") == (2, 11)
    assert torch_release("nightly") == (0, 0)
