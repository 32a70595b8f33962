"""Activations traced on fake tensors: what they cover, shallow traces, and a check against real training."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefect_accelerate.errors import EstimateError
from prefect_accelerate.memory import EstimateOptions, estimate
from prefect_accelerate.memory.activations import trace_activations
from prefect_accelerate.memory.depth import builds_the_prefix, checkpoint_layers, shallow_plan
from prefect_accelerate.memory.build import build_trained_model, to_fake
from prefect_accelerate.memory.resolve import resolve_model
from prefect_accelerate.memory.strategies import _forward_phase


def traced(folder, **options):
    result = estimate(str(folder), EstimateOptions(dtypes=("float32",), strategy=options.pop("strategy", "ddp"), **options))
    return result.profile.activations, result.breakdown


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-bert", "tiny-t5", "tiny-mixtral", "vit", "timm-resnet50"])
def test_every_kind_of_model_is_traced(zoo, name):
    acts, breakdown = traced(zoo[name], seq_len=32 if name.startswith("tiny") else None)
    assert acts.method == "traced", acts.note
    assert acts.saved_bytes > 0
    assert breakdown.item("activations").bytes == acts.saved_bytes + acts.retained_output_bytes + acts.cache_unsaved_bytes


FIELDS = ("saved_bytes", "outside_layers_bytes", "outside_after_layers_bytes", "per_layer_bytes", "layer_input_bytes",
          "block_input_bytes", "block_backward_peaks", "block_backward_gradient_bytes", "block_parameters",
          "block_cast_bytes", "block_recompute_peaks", "outside_gap_bytes", "retained_output_bytes", "largest_tensor_bytes",
          "forward_peak_bytes", "block_forward_rise_bytes", "block_backward_peak_bytes", "head_backward_bytes",
          "autocast_weight_copy_bytes", "unreached_parameters", "block_carry_bytes", "block_backward_waiting_bytes",
          "block_checkpointed_rises",
          # transformers' training-time KV cache, one layer per block (a hybrid's Mamba blocks hold no keys)
          "cache_bytes", "cache_unsaved_bytes")


def _shallow_and_full(folder, precision_mode="fp32", **trace):
    """The trace of the whole stack, the trace of its shallow plan, and the plan."""
    source = resolve_model(str(folder))
    full, _ = build_trained_model(source, False, None)
    plan = shallow_plan(full.config, full)
    assert plan is not None
    short, _ = build_trained_model(source, False, None, config=plan.config)
    assert builds_the_prefix(plan, short)
    # checkpointing: the rises of a forward without saved tensors are measured too, and compared like the rest
    trace = dict(library="transformers", batch_size=2, seq_len=48, precision_mode=precision_mode, device_type="cpu",
                 checkpointing=True) | trace
    whole = trace_activations(to_fake(full), **trace)
    extrapolated = trace_activations(to_fake(short), layout=plan.layout, **trace)
    return whole, extrapolated, plan


def test_shallow_trace_of_identical_blocks_matches_the_full_trace(zoo):
    whole, extrapolated, plan = _shallow_and_full(zoo["tiny-llama"])
    assert (plan.config.num_hidden_layers, len(plan.layout)) == (2, 10)
    assert len(extrapolated.per_layer_bytes) == len(whole.per_layer_bytes) == 10
    for field in FIELDS:
        assert getattr(extrapolated, field) == getattr(whole, field), field
    assert "Traced 2 of 10 blocks" in extrapolated.note


def _stacks():
    """Deep stacks whose blocks differ by a rule of the family's own, none of them spelled like another's."""
    import transformers

    small = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=300,
                 max_position_embeddings=256, num_hidden_layers=9)
    return {
        # experts every third block, a plain MLP in the others (decoder_sparse_step)
        "qwen2-moe": lambda: transformers.Qwen2MoeConfig(
            **small, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            decoder_sparse_step=3, architectures=["Qwen2MoeForCausalLM"]),
        # a dense MLP in the first 3 blocks, experts after (first_k_dense_replace)
        "deepseek-v3": lambda: transformers.DeepseekV3Config(
            **{**small, "num_key_value_heads": 4}, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            n_group=1, topk_group=1, first_k_dense_replace=3, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16, architectures=["DeepseekV3ForCausalLM"]),
        # one attention block among Mamba blocks, by index (attn_layer_indices)
        "bamba": lambda: transformers.BambaConfig(
            **small, attn_layer_indices=[5], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
            architectures=["BambaForCausalLM"]),
        # a per-block list: two sliding-window blocks, then a full one
        "layer-types": lambda: transformers.Qwen2Config(
            **small, sliding_window=16, use_sliding_window=True, max_window_layers=0,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 3,
            architectures=["Qwen2ForCausalLM"]),
    }


@pytest.mark.parametrize("name", ["qwen2-moe", "deepseek-v3", "bamba", "layer-types"])
def test_a_stack_of_mixed_blocks_is_traced_with_every_kind_and_matches_the_full_trace(tmp_path, name):
    """A shallow copy of the first two blocks traced none of the blocks a family's own rule puts further down (a
    Bamba stack with one attention block came out 13% over its CPU peak, a Qwen2-MoE stack with experts every third
    block 9% under). The plan keeps the shortest prefix holding every kind of block and repeats each kind's last."""
    _stacks()[name]().save_pretrained(tmp_path)
    whole, extrapolated, plan = _shallow_and_full(tmp_path)
    assert 2 <= plan.config.num_hidden_layers < 9 and len(plan.layout) == 9
    assert len(set(plan.kinds)) >= 2  # the stack really mixes blocks
    for field in FIELDS:
        # to the byte but for the odd scalar a model makes once at some block (Bamba: 24 bytes in 128 MB)
        assert getattr(extrapolated, field) == pytest.approx(getattr(whole, field), rel=1e-5, abs=64), field


def test_a_shallow_copy_that_builds_another_stack_is_not_used(zoo):
    """A config whose rule reads its own depth builds a shallow copy whose blocks are not the real stack's first
    ones: the check sees it, and the stack is traced in full."""
    source = resolve_model(str(zoo["tiny-llama"]))
    full, _ = build_trained_model(source, False, None)
    plan = shallow_plan(full.config, full)
    other = copy.deepcopy(plan.config)
    other.intermediate_size *= 2
    other_model, _ = build_trained_model(source, False, None, config=other)
    assert not builds_the_prefix(plan, other_model)


def test_the_position_of_a_block_is_not_its_kind(zoo):
    """`layer_idx` differs in every block, and so does a config list that numbers the blocks (Llama 4's
    `moe_layers` when every block has experts, LFM2's `full_attn_idxs` when every block attends): both say where
    a block sits. A list with repeats says what it is."""
    source = resolve_model(str(zoo["tiny-llama"]))
    full, _ = build_trained_model(source, False, None)
    full.config.numbered_blocks = list(range(10))
    plan = shallow_plan(full.config, full)
    assert any(name.endswith("layer_idx") for name in plan.positional) and "numbered_blocks" in plan.positional
    assert plan.layout == [0, 1] + [1] * 8 and plan.config.numbered_blocks == [0, 1]
    full.config.numbered_blocks = ["a", "a", "a", "b"] * 2 + ["a", "a"]
    plan = shallow_plan(full.config, full)
    assert plan.layout == [0, 1, 2, 3, 2, 2, 2, 3, 2, 2] and plan.config.numbered_blocks == ["a", "a", "a", "b"]


def test_gradient_checkpointing_keeps_block_inputs_and_the_larger_backward_phase(zoo):
    plain, full = traced(zoo["tiny-llama"], seq_len=64, batch_size=4)
    _, checkpointed = traced(zoo["tiny-llama"], seq_len=64, batch_size=4, gradient_checkpointing=True)
    before = plain.outside_layers_bytes - plain.outside_after_layers_bytes
    phase = max(plain.outside_after_layers_bytes, max(plain.per_layer_bytes))
    kept = checkpointed.item("activations").bytes
    # the recomputed block holds what it saved but its own inputs, which checkpointing keeps already
    assert 0 < plain.block_saved_input_bytes < max(plain.per_layer_bytes)
    recomputed = max(plain.per_layer_bytes) - plain.block_saved_input_bytes
    assert kept in (before + plain.layer_input_bytes + plain.retained_output_bytes + plain.outside_after_layers_bytes,
                    before + plain.layer_input_bytes + plain.retained_output_bytes + recomputed)
    assert kept <= before + plain.layer_input_bytes + plain.retained_output_bytes + phase
    assert kept < full.item("activations").bytes


def test_activations_grow_with_the_batch(zoo):
    one, _ = traced(zoo["tiny-gpt2"], seq_len=32, batch_size=1)
    four, _ = traced(zoo["tiny-gpt2"], seq_len=32, batch_size=4)
    assert 3.5 * one.saved_bytes < four.saved_bytes <= 4 * one.saved_bytes


def test_ddp_autocast_weight_copies_are_counted_apart(zoo):
    acts, ddp = traced(zoo["tiny-gpt2"], seq_len=32, mixed_precision="bf16")
    assert acts.precision_mode == "autocast-bf16"
    assert acts.autocast_weight_copy_bytes > 0
    assert "autocast" in ddp.item("backward_temporaries").formula
    zero_acts, zero = traced(zoo["tiny-gpt2"], seq_len=32, mixed_precision="bf16", strategy="zero2", num_processes=2)
    assert zero_acts.precision_mode == "bf16" and zero_acts.autocast_weight_copy_bytes == 0
    assert zero.item("activations").bytes < traced(zoo["tiny-gpt2"], seq_len=32)[1].item("activations").bytes


def test_seq_len_past_learned_positions_is_refused(zoo):
    with pytest.raises(EstimateError, match="--seq_len 128 is longer than GPT2LMHeadModel can take.*64 tokens"):
        traced(zoo["tiny-gpt2"], seq_len=128)


def test_default_seq_len_is_the_models_maximum_capped(zoo):
    acts, _ = traced(zoo["tiny-gpt2"])
    assert acts.seq_len == 64


def test_untraceable_model_is_reported_not_guessed(zoo, monkeypatch):
    import transformers

    def data_dependent(self, *args, **kwargs):
        raise RuntimeError("data-dependent control flow")

    monkeypatch.setattr(transformers.GPT2LMHeadModel, "forward", data_dependent)
    acts, breakdown = traced(zoo["tiny-gpt2"], seq_len=16)
    assert acts.method == "not estimated"
    assert breakdown.activations_method == "not estimated"
    assert any("does not run on fake tensors" in note for note in breakdown.notes)


@pytest.mark.slow
def test_estimate_is_within_15_percent_of_real_cpu_training(zoo):
    """The bench's measurement in small: peak live tensors of real AdamW steps (MemTracker) vs the estimate."""
    import torch
    import transformers
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(zoo["tiny-llama"])
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    ids = torch.randint(1, config.vocab_size, (4, 128))
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        for step in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 0:
                tracker.reset_mod_stats()
    peak = tracker.get_tracker_snapshot("peak")
    measured = next(iter(peak.values()))["Total"]
    _, breakdown = traced(zoo["tiny-llama"], seq_len=128, batch_size=4, device_type="cpu")  # CPU's own kernels
    assert 0.85 < breakdown.device_total_bytes / measured < 1.15


@pytest.mark.parametrize("name", ["timm-resnet50", "vit"])
def test_sixteen_bit_weights_take_sixteen_bit_images(zoo, name):
    fp32, _ = traced(zoo[name], strategy="zero2", num_processes=2, batch_size=2)
    bf16, _ = traced(zoo[name], strategy="zero2", num_processes=2, batch_size=2, mixed_precision="bf16")
    assert bf16.precision_mode == "bf16"
    assert 0.45 < bf16.saved_bytes / fp32.saved_bytes < 0.6


@pytest.mark.slow
def test_checkpointed_estimate_is_within_10_percent_of_real_cpu_training_with_torch_checkpoint(zoo):
    """transformers' gradient_checkpointing_enable (torch.utils.checkpoint, non-reentrant) measured with MemTracker."""
    import torch
    import transformers
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(zoo["tiny-llama"])
    model = transformers.LlamaForCausalLM(config).train()
    model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    ids = torch.randint(1, config.vocab_size, (8, 256))
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        for step in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 0:
                tracker.reset_mod_stats()
    measured = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
    _, breakdown = traced(zoo["tiny-llama"], seq_len=256, batch_size=8, device_type="cpu", gradient_checkpointing=True)
    assert 0.95 < breakdown.device_total_bytes / measured < 1.10


def _block_with_python_backward(temporaries: int):
    """A transformers-free toy stack: each block is a Linear then an autograd Function whose backward makes
    ``temporaries`` tensors of its input's size that are all alive at once (as Bloom's GeLU backward does)."""
    import torch

    class Spendthrift(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # noqa: ANN001, ANN205
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001, ANN205
            (x,) = ctx.saved_tensors
            held = [x * k for k in range(1, temporaries + 1)]
            return grad * 2 + sum(held) * 0

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(64, 64)

        def forward(self, x):  # noqa: ANN001, ANN202
            return Spendthrift.apply(self.linear(x))

    class Stack(torch.nn.Module):
        _no_split_modules = ["Block"]

        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])

        def forward(self, x):  # noqa: ANN001, ANN202
            for block in self.blocks:
                x = block(x)
            return x

    return Stack()


@pytest.mark.parametrize("temporaries", [1, 6])
def test_a_blocks_backward_is_measured_on_fake_tensors_with_its_own_temporaries(temporaries):
    """The backward runs on the fake graph: a block whose backward code keeps six input-sized temporaries at once
    is measured as holding them, where a bound from the forward (saved tensors plus two gradients) would not."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from prefect_accelerate.memory.activations import _measure_backward, _SavedTensorRecorder

    model = _block_with_python_backward(temporaries)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake = mode.from_tensor
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                setattr(module, name, torch.nn.Parameter(fake(param.detach())))
        params = {id(p) for p in model.parameters()}
        recorder = _SavedTensorRecorder(params)
        for block in model.blocks:
            block.register_forward_pre_hook(recorder.enter_layer, with_kwargs=True)
            block.register_forward_hook(recorder.leave_layer)
        x = torch.zeros(32, 64, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
            loss = model(x).sum()
    measured = _measure_backward(loss, recorder, mode, list(model.parameters())).blocks
    size = 32 * 64 * 4
    assert set(measured) == {0, 1}
    for index, peak in measured.items():
        saved = recorder.saved_in[index]
        # the block's saved tensors, the gradient it starts from and the temporaries, all at once
        assert peak >= saved + size + temporaries * size
        assert peak <= saved + size * (temporaries + 4) + 64 * 64 * 4 + 64 * 4
    if temporaries == 6:
        assert max(measured.values()) > max(recorder.block_peak.values())


def test_a_block_module_called_twice_is_two_blocks():
    """A model that loops over its blocks (recurrent depth) calls one module several times; checkpointing wraps
    each call, so each call is a block of its own with what that call saved (once counted as one block holding
    both calls' tensors, which a checkpointed estimate then recomputed all at once: 1.38x the real peak)."""
    import torch

    from prefect_accelerate.memory.activations import _SavedTensorRecorder

    block = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
    params = {id(p) for p in block.parameters()}
    recorder = _SavedTensorRecorder(params)
    block.register_forward_pre_hook(recorder.enter_layer, with_kwargs=True)
    block.register_forward_hook(recorder.leave_layer)
    x = torch.zeros(8, 16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
        block(block(x)).sum()
    assert len(recorder.layer_index) == 2
    # the first call saved its Linear's input and its Tanh's output (8 x 16 fp32 each); the second call's Linear
    # input is the first call's output, counted already, so it adds its own Tanh output only
    assert recorder.saved_in == {0: 2 * 8 * 16 * 4, 1: 8 * 16 * 4}


def _wide_transient_model():
    """A block whose forward makes a tensor 32 times its input (an outer product, as a state-space scan written in
    plain torch does) and reduces it at once: little is saved, but the forward's moment is large."""
    import torch

    class Scan(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(64, 64)
            self.state = torch.nn.Parameter(torch.ones(32))

        def forward(self, x):  # noqa: ANN001, ANN202
            h = self.linear(x)
            wide = h.unsqueeze(-1) * self.state  # (batch, 64, 32): 32x the input
            return wide.sum(-1).tanh()

    return Scan()


def test_the_forwards_moment_measured_on_fake_tensors_matches_the_cpu_allocator():
    """The forward is counted as it runs (`_LiveBytes`): its peak on fake tensors is what PyTorch's CPU allocator
    reports for the same forward on real tensors, the 32x transient included."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from prefect_accelerate.memory.activations import _LiveBytes
    from prefect_accelerate.memory.probe import allocation_peak, allocation_recorder

    torch.manual_seed(0)
    model = _wide_transient_model()
    recorder = allocation_recorder()
    with recorder:
        x = torch.zeros(256, 64, requires_grad=True)
        loss = model(x).sum()
    real = allocation_peak(recorder)
    del loss

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    meter = _LiveBytes()
    with mode:
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                setattr(module, name, torch.nn.Parameter(mode.from_tensor(param.detach())))
        with meter:
            x = torch.zeros(256, 64, requires_grad=True)
            model(x).sum()
    transient = 256 * 64 * 32 * 4
    assert meter.peak >= transient
    assert abs(meter.peak - real) <= 0.05 * real, (meter.peak, real)


def test_a_forward_that_outgrows_backward_sets_the_peak():
    """The layouts take the forward's measured moment as a phase of its own (plus the previous step's outputs,
    alive until the new forward returns), and say so when it is the peak."""
    from prefect_accelerate.memory.models import ActivationProfile, EstimateOptions
    from prefect_accelerate.memory.strategies import _forward_phase

    acts = ActivationProfile(method="traced", batch_size=4, seq_len=128, input_description="", precision_mode="fp32",
                             saved_bytes=10, per_layer_bytes=[4, 4], outside_layers_bytes=2, outside_after_layers_bytes=1,
                             layer_input_bytes=6, forward_peak_bytes=1000, block_forward_rise_bytes=100, forward_measured=True)
    options = EstimateOptions(dtypes=("float32",), strategy="ddp", batch_size=8, seq_len=128)
    assert _forward_phase(acts, options) == 2000  # scaled to the batch
    checkpointed = options.model_copy(update={"gradient_checkpointing": True})
    assert _forward_phase(acts, checkpointed) == 2 * (1 + 6 + 100)  # before the blocks + kept inputs + one block
    # with the rises of a forward that keeps no saved tensor, block by block: what was saved outside the blocks
    # before it, the inputs kept of it and of those before it, the previous block's outputs still held, its rise
    blocks = acts.model_copy(update={"block_checkpointed_rises": [50, 30], "block_input_bytes": [2, 4],
                                     "outside_gap_bytes": [1, 3, 9], "block_carry_bytes": [0, 20]})
    assert _forward_phase(blocks, checkpointed) == 2 * max(1 + 2 + 0 + 50, 1 + 3 + 2 + 4 + 20 + 30)
    assert _forward_phase(acts.model_copy(update={"forward_measured": False}), options) == 0


def test_a_forward_that_fails_with_the_training_kv_cache_is_traced_as_checkpointing_runs_it(tmp_path):
    """transformers builds a KV cache in training unless checkpointing turns it off; for a hybrid stack whose
    layers here are all linear attention (Bamba), that cache makes transformers' own forward fail. The trace
    then runs the forward without it, as a checkpointed run does, and says so (it was "not estimated"). With
    --gradient_checkpointing the model's own switches turn the cache off, and the first forward is traced."""
    import transformers

    config = transformers.BambaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=1000, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
        architectures=["BambaForCausalLM"])
    config.save_pretrained(tmp_path)
    options = EstimateOptions(dtypes=("float32",), strategy="ddp", batch_size=4, seq_len=128, device_type="cpu")
    acts = estimate(str(tmp_path), options).profile.activations
    assert acts.method == "traced" and acts.saved_bytes > 0
    assert "without transformers' KV cache" in acts.note and "get_mask_sizes" in acts.note
    checkpointed = estimate(str(tmp_path), options.model_copy(update={"gradient_checkpointing": True})).profile.activations
    assert checkpointed.method == "traced" and "KV cache" not in checkpointed.note
    assert checkpointed.saved_bytes == acts.saved_bytes


def test_use_cache_reaches_a_base_model_through_the_heads_kwargs(tmp_path):
    """GraniteMoeHybridForCausalLM names no `use_cache`: it hands its **kwargs to the base model, which takes it.
    The trace turns the training cache off through them as a checkpointed run does, when the forward fails with it
    (it was "not estimated":
    the forward with the cache fails in transformers itself for an all-linear-attention stack)."""
    import transformers

    config = transformers.GraniteMoeHybridConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=1000, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, num_local_experts=2,
        num_experts_per_tok=1, layer_types=["mamba", "mamba"], architectures=["GraniteMoeHybridForCausalLM"])
    config.save_pretrained(tmp_path)
    assert "use_cache" not in __import__("inspect").signature(transformers.GraniteMoeHybridForCausalLM.forward).parameters
    result = estimate(str(tmp_path), EstimateOptions(dtypes=("float32",), strategy="ddp", batch_size=2, seq_len=64,
                                                     device_type="cpu"))
    acts = result.profile.activations
    assert acts.method == "traced" and acts.saved_bytes > 0, acts.note
    assert "without transformers' KV cache" in acts.note


def test_a_config_whose_depth_is_not_its_block_count_is_traced_at_full_depth(tmp_path):
    """HRM's num_hidden_layers counts KV-cache slots over the two stacks it loops (2 blocks a stack, 16 slots), not
    blocks. A copy with num_hidden_layers=2 is then not the same model with fewer blocks (its cache is too short:
    the trace failed and, retried without the cache, missed the 0.92x it holds). It is traced as it is; each
    block call with a gradient has its backward measured (the calls it runs under no_grad have none)."""
    import transformers

    from prefect_accelerate.memory.build import build_trained_model

    config = transformers.HrmTextConfig(
        hidden_size=128, num_attention_heads=4, head_dim=32, intermediate_size=256, vocab_size=1000,
        max_position_embeddings=512, architectures=["HrmTextForCausalLM"])
    config.save_pretrained(tmp_path)
    assert config.num_hidden_layers >= 8  # deep enough to be traced shallow, were its depth its blocks
    source = resolve_model(str(tmp_path))
    model, _ = build_trained_model(source, False, None, "float32")
    assert len(checkpoint_layers(model)) != config.num_hidden_layers
    assert shallow_plan(model.config, model) is None
    result = estimate(str(tmp_path), EstimateOptions(dtypes=("float32",), strategy="ddp", batch_size=4, seq_len=128,
                                                     device_type="cpu"))
    acts = result.profile.activations
    assert acts.method == "traced" and "KV cache" not in acts.note and "Traced" not in acts.note
    assert acts.block_backward_measured and acts.forward_measured


def test_layerdrop_is_traced_with_every_block_kept(tmp_path):
    """M2M100 drops each block with probability 0.05 in training, drawing `torch.rand([])` and comparing it in
    Python; fake tensors cannot compare a draw, so it was "not estimated". The trace now keeps every block (the
    step that holds the most), and the other draws stay torch's own."""
    import torch
    import transformers

    config = transformers.M2M100Config(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                       decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                       vocab_size=500, architectures=["M2M100ForConditionalGeneration"])
    assert config.encoder_layerdrop > 0 and config.decoder_layerdrop > 0
    config.save_pretrained(tmp_path)
    full = estimate(str(tmp_path), EstimateOptions(dtypes=("float32",), strategy="ddp", batch_size=2, seq_len=32,
                                                   device_type="cpu")).profile.activations
    assert full.method == "traced"
    assert len(full.per_layer_bytes) == 4 and min(full.per_layer_bytes) > 0  # no block dropped
    assert torch.rand([]).item() < 1.0 and torch.rand(3).shape == (3,)  # torch's own again


def test_parameters_the_loss_never_reaches_get_no_gradient_and_no_optimizer_state(tmp_path):
    """BartForCausalLM is BART's decoder alone: its cross-attention weights are built but never used, so real
    training leaves their .grad None and AdamW makes no state for them. The fake backward finds exactly those
    parameters; one process (no DDP wrapper) then counts gradients and states for the rest only."""
    import torch
    import transformers

    config = transformers.BartConfig(d_model=64, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128,
                                     encoder_layers=2, vocab_size=500, architectures=["BartForCausalLM"])
    config.save_pretrained(tmp_path)
    model = transformers.BartForCausalLM(config).train()
    ids = torch.randint(1, 500, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    real = sum(p.numel() for p in model.parameters() if p.requires_grad and p.grad is None)
    assert real > 0

    options = EstimateOptions(dtypes=("float32",), strategy="ddp", batch_size=2, seq_len=32, device_type="cpu")
    result = estimate(str(tmp_path), options)
    assert result.profile.activations.unreached_parameters == real
    trainable = result.profile.trainable_parameters
    assert result.breakdown.item("gradients").bytes == 4 * (trainable - real)
    assert result.breakdown.item("optimizer_states").bytes == 8 * (trainable - real)
    assert any("get no gradient" in note for note in result.breakdown.notes)
    # several processes: DDP's buckets cover every parameter, so nothing is taken off
    two = estimate(str(tmp_path), options.model_copy(update={"num_processes": 2}))
    assert two.breakdown.item("gradients").bytes == 4 * trainable


def test_the_heads_weight_gradients_are_measured_once_not_added_by_rule(tmp_path, train_and_measure):
    """RemBERT's MLM head projects to a width (1664) far above the model's (128), so its output layer is the
    largest weight and its gradient is made in the head's phase of backward. The fake backward sees that
    gradient made by an ordinary op before autograd accumulates it, so the head's measured rise holds it
    already; a rule that added "4 B x the largest weight" on top counted it twice (1.103 of the allocator's
    peak). The gradient moves to the gradient side of the head's record once accumulated (it does not grow
    with the batch), and the estimate sits on the allocator's peak."""
    import transformers

    config = transformers.RemBertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                                        input_embedding_size=256, output_embedding_size=1664, vocab_size=1000,
                                        max_position_embeddings=512, attention_probs_dropout_prob=0.0,
                                        hidden_dropout_prob=0.0, pad_token_id=0, architectures=["RemBertForMaskedLM"])
    config.save_pretrained(tmp_path)
    options = EstimateOptions(dtypes=("float32",), strategy="ddp", batch_size=4, seq_len=128, device_type="cpu")
    result = estimate(str(tmp_path), options)
    acts = result.profile.activations
    decoder = 4 * 1664 * 1000
    assert acts.head_backward_measured and acts.head_gradient_bytes >= decoder  # the output layer's, made in the head
    assert acts.head_backward_gradient_bytes + acts.head_backward_bytes >= decoder  # at the head's highest point
    assert "largest weight" not in result.breakdown.item("backward_temporaries").formula
    measured = train_and_measure(tmp_path, {"batch": 4, "seq": 128, "precision": "no", "checkpointing": False})
    ratio = result.breakdown.device_total_bytes / measured
    assert 0.98 <= ratio <= 1.02, ratio
    # a larger batch scales the activations' part of the head's rise, not the gradients made by then
    double = estimate(str(tmp_path), options.model_copy(update={"batch_size": 8}))
    rise = lambda r: r.breakdown.item("backward_temporaries").bytes  # noqa: E731
    assert rise(double) <= 2 * rise(result)


def test_a_tied_embeddings_gradient_started_by_the_head_stays_through_the_blocks():
    """With tied input and output embeddings, the output layer's share of the gradient is made in the head's
    phase and autograd holds it until the embedding's own share is added, after the last block: it is part of
    what the head leaves alive for the blocks' phase. Untied, the output layer's gradient is accumulated at
    once and counted as a gradient instead."""
    import tempfile

    import transformers

    found = {}
    for tied in (True, False):
        folder = tempfile.mkdtemp()
        transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=2000, bos_token_id=0, eos_token_id=0,
                                tie_word_embeddings=tied, architectures=["GPT2LMHeadModel"]).save_pretrained(folder)
        found[tied] = estimate(folder, EstimateOptions(dtypes=("float32",), strategy="ddp", batch_size=4, seq_len=128,
                                                       device_type="cpu")).profile.activations
    table = 4 * 2000 * 128
    assert found[True].head_left_bytes + found[True].head_gradient_bytes >= table
    assert found[False].head_gradient_bytes >= table and found[False].head_left_bytes < table


def test_backward_is_followed_block_by_block_when_the_blocks_differ():
    """Backward runs the blocks last to first; while it runs block k it holds the saved tensors of the blocks
    before k, block k at its own highest point, and the gradients of the head and of the blocks after k. With
    a heavy block in the middle the peak is there, neither at backward's start nor at its end; its
    activations grow with the batch and its gradients do not."""
    from prefect_accelerate.memory.models import ActivationProfile, EstimateOptions, ModelProfile
    from prefect_accelerate.memory.strategies import _block_phases

    acts = ActivationProfile(
        method="traced", batch_size=4, seq_len=128, input_description="", precision_mode="fp32",
        saved_bytes=3 + 120, outside_layers_bytes=3, outside_after_layers_bytes=2, per_layer_bytes=[10, 100, 10],
        block_input_bytes=[1, 1, 1], block_backward_peaks=[12, 130, 12], block_backward_gradient_bytes=[0, 8, 0],
        block_parameters=[5, 5, 5], head_backward_measured=True, head_gradient_bytes=40, head_left_bytes=0,
        retained_output_bytes=0, block_saved_input_bytes=1, block_recompute_peaks=[5, 50, 5], outside_gap_bytes=[1, 0, 0, 2])
    profile = ModelProfile.model_construct(activations=acts, trainable_parameters=25, parameters=25)
    options = EstimateOptions(dtypes=("float32",), strategy="ddp", batch_size=4, seq_len=128)
    gradients = 4 * 25
    value, where = _block_phases(profile, options, gradients)
    # block 1: before the blocks (1) + block 0's saved (10) + its own highest point (130); gradients: the head's
    # 10 parameters + block 2's 5 + the 2 block 1 had made by then, 4 B each
    assert where == 1 and value == 1 + 10 + 130 + 4 * (10 + 5 + 2)
    doubled, _ = _block_phases(profile, options.model_copy(update={"batch_size": 8}), gradients)
    assert doubled == 2 * (1 + 10 + 130) + 4 * 17
    # checkpointed: the kept inputs of blocks 0..1 and block 1 recomputed less its own input
    checkpointed, where = _block_phases(profile, options.model_copy(update={"gradient_checkpointing": True}), gradients)
    assert where == 1 and checkpointed == 1 + 2 + (130 - 1) + 4 * 17
    # a recomputing forward that rises above the block's backward sets the block's figure (no gradients yet)
    heavy = profile.model_copy(update={"activations": acts.model_copy(update={"block_recompute_peaks": [5, 200, 5]})})
    recomputing, where = _block_phases(heavy, options.model_copy(update={"gradient_checkpointing": True}), gradients)
    assert where == 1 and recomputing == 1 + 2 + 200 + 4 * (10 + 5)
    # saved between two stacks (an encoder-decoder's encoder norm): alive for the blocks after it only
    between = profile.model_copy(update={"activations": acts.model_copy(update={"outside_gap_bytes": [1, 7, 0, 2]})})
    assert _block_phases(between, options, gradients)[0] == value + 7
    # a gradient the backward of later blocks left waiting (a tensor several blocks take): alive in that block's
    # phase, growing with the batch
    waiting = profile.model_copy(update={"activations": acts.model_copy(update={"block_backward_waiting_bytes": [0, 9, 0]})})
    assert _block_phases(waiting, options, gradients)[0] == value + 9
    assert _block_phases(waiting, options.model_copy(update={"batch_size": 8}), gradients)[0] == doubled + 18
    # sharded gradients (a layout's gradient bytes per parameter): the gradients' part shrinks with them
    sharded, _ = _block_phases(profile, options, gradients / 4)
    assert sharded == 1 + 10 + 130 + 17
    # DDP with autocast: the 16-bit weight copies blocks 0..1 saved, and those outside the blocks (2), are held
    # too; checkpointed, only block 1's (recomputing it makes them again)
    cast = profile.model_copy(update={"activations": acts.model_copy(update={
        "block_cast_bytes": [3, 3, 3], "autocast_weight_copy_bytes": 11})})
    with_casts, _ = _block_phases(cast, options, gradients, keeps_casts=True)
    assert with_casts == value + 2 + 3 + 3
    recomputed, _ = _block_phases(cast, options.model_copy(update={"gradient_checkpointing": True}), gradients, keeps_casts=True)
    assert recomputed == checkpointed + 2 + 3


def test_an_encoder_decoders_checkpointed_backward_holds_what_lies_between_its_stacks(tmp_path, train_and_measure):
    """Switch Transformers (T5's layout over experts) saves tensors between its two stacks: the encoder's final
    norm and dropout, the decoder's embeddings. Backward frees them only after every decoder block, so they are
    alive while each decoder block is recomputed and run backward; counted as the head's (freed first) the
    checkpointed estimate sat at 0.942 of the CPU allocator's peak. The recomputing forward's own highest point
    (its dropout masks, the router's fp32 copies) counts too."""
    import transformers

    config = transformers.SwitchTransformersConfig(
        d_model=128, d_ff=256, d_kv=32, num_heads=4, num_layers=2, num_decoder_layers=2, vocab_size=1000,
        num_experts=4, pad_token_id=0, eos_token_id=0, decoder_start_token_id=0, tie_word_embeddings=False,
        architectures=["SwitchTransformersForConditionalGeneration"])
    config.save_pretrained(tmp_path)
    result = estimate(str(tmp_path), EstimateOptions(dtypes=("float32",), strategy="ddp", batch_size=4, seq_len=128,
                                                     gradient_checkpointing=True, device_type="cpu"))
    acts = result.profile.activations
    between = acts.outside_gap_bytes[1:-1]
    assert len(acts.outside_gap_bytes) == len(acts.per_layer_bytes) + 1 and sum(between) > 0
    measured = train_and_measure(tmp_path, {"batch": 4, "seq": 128, "precision": "no", "checkpointing": True})
    ratio = result.breakdown.device_total_bytes / measured
    assert 0.97 <= ratio <= 1.05, ratio


def test_a_config_that_refuses_a_new_depth_is_traced_at_its_own(tmp_path):
    """ProphetNetForCausalLM's config raises NotImplementedError when `num_hidden_layers` is set (it wants the
    encoder's and decoder's counts). The shallow copy gives up and the model is traced as it is: the command
    printed a traceback (found by the family walk's seed-29 sample)."""
    import subprocess
    import sys

    import transformers

    transformers.ProphetNetConfig(hidden_size=64, num_encoder_layers=2, num_decoder_layers=6, num_encoder_attention_heads=4,
                                  num_decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=500,
                                  architectures=["ProphetNetForCausalLM"]).save_pretrained(tmp_path)
    model, _ = build_trained_model(resolve_model(str(tmp_path)), False, None)
    assert shallow_plan(model.config, model) is None
    done = subprocess.run([sys.executable, "-m", "prefect_accelerate.cli.main", "estimate-memory", str(tmp_path),
                           "--strategy", "ddp", "--batch_size", "2", "--seq_len", "32", "--no-track"],
                          capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "PREFECT_ACCELERATE_PROFILE_CACHE": "off"})
    assert done.returncode == 0 and "Traceback" not in done.stderr + done.stdout, done.stderr[-2000:]
    assert "Total per device" in done.stdout


def test_what_the_stack_keeps_of_a_blocks_outputs_is_measured_from_the_models_own_references(tmp_path):
    """Bloom's stack runs `outputs = block(...)` and keeps the tuple, attention probabilities included, until the
    next block returns; Llama's blocks return their hidden state alone, the next block's input. The trace asks
    CPython's reference count, not the model's name: the probabilities (batch x heads x seq x seq, fp32) are
    carried into every block after the first, nothing into Llama's, and only a checkpointed forward adds them
    (without checkpointing the same tensors are saved for backward, and counted there)."""
    import transformers

    bloom, llama = tmp_path / "bloom", tmp_path / "llama"
    transformers.BloomConfig(hidden_size=64, n_layer=3, n_head=2, vocab_size=500,
                             architectures=["BloomForCausalLM"]).save_pretrained(bloom)
    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
                             num_key_value_heads=2, vocab_size=500, max_position_embeddings=512, bos_token_id=0,
                             eos_token_id=0, pad_token_id=0, architectures=["LlamaForCausalLM"]).save_pretrained(llama)
    probabilities = 2 * 2 * 256 * 256 * 4
    acts, _ = traced(bloom, batch_size=2, seq_len=256, device_type="cpu")
    assert acts.block_carry_bytes == [0, probabilities, probabilities]
    options = EstimateOptions(dtypes=("float32",), strategy="ddp", batch_size=2, seq_len=256, device_type="cpu")
    without = acts.model_copy(update={"block_carry_bytes": [0, 0, 0]})
    assert _forward_phase(acts, options) == _forward_phase(without, options)
    options = options.model_copy(update={"gradient_checkpointing": True})
    assert _forward_phase(acts, options) - _forward_phase(without, options) == probabilities
    acts, _ = traced(llama, batch_size=2, seq_len=256, device_type="cpu")
    assert acts.block_carry_bytes == [0, 0, 0]


def test_a_gradient_several_blocks_add_to_is_held_until_the_backward_of_what_made_it(tmp_path):
    """T5's first block of each stack makes the position bias (from a trained table) and passes it to the blocks
    after it; every decoder block attends to the encoder's output. Backward runs the blocks last to first, and the
    gradient of such a tensor is summed as each block that took it runs backward, alive until the backward of
    what made it: the first block's, or the encoder's final norm. The fake backward measures what the later blocks
    left alive when each block's backward begins, besides the gradient that block starts from; a stack that only
    passes its hidden state on (Llama) leaves nothing waiting."""
    import transformers

    t5, llama = tmp_path / "t5", tmp_path / "llama"
    transformers.T5Config(d_model=64, d_kv=32, d_ff=128, num_layers=3, num_decoder_layers=3, num_heads=2, vocab_size=500,
                          architectures=["T5ForConditionalGeneration"]).save_pretrained(t5)
    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
                             num_key_value_heads=2, vocab_size=500, max_position_embeddings=512, bos_token_id=0,
                             eos_token_id=0, pad_token_id=0, architectures=["LlamaForCausalLM"]).save_pretrained(llama)
    bias = 1 * 2 * 256 * 256 * 4  # heads x seq x seq, fp32 (no padding mask given: one for the whole batch)
    encoder_output = 2 * 256 * 64 * 4
    acts, _ = traced(t5, batch_size=2, seq_len=256, device_type="cpu")
    # encoder blocks 0-2, then decoder blocks 3-5: the last block of each stack starts with nothing waiting
    assert acts.block_backward_waiting_bytes == [bias, bias, 0, bias + encoder_output, bias + encoder_output, 0]
    acts, _ = traced(llama, batch_size=2, seq_len=256, device_type="cpu")
    assert acts.block_backward_waiting_bytes == [0, 0, 0]


def _dory(folder):
    """Dory: 4 input blocks, 4 middle blocks it runs twice (its loop), 4 output blocks; each fourth block attends
    to the whole sequence, the others to a window. Its forward deep-copies its KV-cache layers for each loop."""
    import transformers

    transformers.DoryConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            intermediate_size=256, vocab_size=1000, max_position_embeddings=512, num_hidden_layers=12,
                            n_input_layers=4, n_output_layers=4, architectures=["DoryForCausalLM"]).save_pretrained(folder)
    return folder


def test_a_stack_that_loops_over_part_of_itself_is_traced_in_full(tmp_path):
    """Dory's shallow copy (its 4-block period) keeps its input and output counts, so it calls its blocks twice:
    its trace cannot stand for the real stack, which the estimate then traces whole."""
    from prefect_accelerate.memory.depth import NotOneCallPerBlock

    source = resolve_model(str(_dory(tmp_path)))
    full, _ = build_trained_model(source, False, None)
    plan = shallow_plan(full.config, full)
    assert plan is not None and len(plan.layout) == 12
    short, _ = build_trained_model(source, False, None, config=plan.config)
    if builds_the_prefix(plan, short):
        with pytest.raises(NotOneCallPerBlock):
            trace_activations(to_fake(short), library="transformers", batch_size=2, seq_len=32, precision_mode="fp32",
                              device_type="cpu", layout=plan.layout)
    whole = trace_activations(to_fake(full), library="transformers", batch_size=4, seq_len=128, precision_mode="fp32",
                              device_type="cpu")
    acts, _ = traced(tmp_path, batch_size=4, seq_len=128, device_type="cpu")
    assert acts.saved_bytes == whole.saved_bytes and acts.forward_peak_bytes == whole.forward_peak_bytes
    assert "Traced" not in acts.note


def test_a_forward_that_deep_copies_fake_tensors_leaves_the_process_sound(tmp_path):
    """Dory deep-copies its cache layers in the forward. torch's deepcopy copied the fake tensors' storage bytes
    from a pointer to nothing, and the next estimate in the same process died of a segmentation fault (a pipeline
    worker runs many). A deep copy on the fake graph is now a clone; the estimate also follows the cache, as
    training does, and lands on the allocator's peak (it was 1.036 of it, traced without the cache)."""
    import subprocess
    import sys

    folder = _dory(tmp_path / "dory")
    code = ("import sys\nfrom prefect_accelerate.memory import EstimateOptions, estimate\n"
            "for checkpointing in (False, True, False, True):\n"
            "    r = estimate(sys.argv[1], EstimateOptions(dtypes=('float32',), strategy='ddp', batch_size=4, seq_len=128,"
            " device_type='cpu', gradient_checkpointing=checkpointing))\n"
            "    print(r.breakdown.device_total_bytes, r.profile.activations.method)\n")
    done = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "PREFECT_ACCELERATE_PROFILE_CACHE": "off"})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.split("\n")[:4]
    assert all(line.endswith("traced") for line in lines) and lines[0] == lines[2] and lines[1] == lines[3]
    assert "data pointer of FakeTensor" not in done.stderr


@settings(max_examples=int(__import__('os').environ.get('MIX_EXAMPLES', 10)), deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(depth=st.integers(8, 12), data=st.data())
def test_any_mix_of_blocks_traced_shallow_gives_the_full_traces_figures(tmp_path_factory, depth, data):
    """The promise, not the examples: a stack whose blocks differ by any pattern (a drawn mix of sliding-window
    and full attention, experts or a plain MLP, by two different config rules at once) is traced shallow only
    where that holds every kind, and then gives every figure of the full trace (or is traced in full)."""
    import transformers

    kinds = data.draw(st.lists(st.sampled_from(["sliding_attention", "full_attention"]), min_size=depth, max_size=depth))
    plain = data.draw(st.lists(st.integers(0, depth - 1), max_size=3, unique=True))
    step = data.draw(st.integers(1, 3))
    folder = tmp_path_factory.mktemp("mix")
    transformers.Qwen2MoeConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=300,
        max_position_embeddings=256, num_hidden_layers=depth, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=step, mlp_only_layers=plain,
        use_sliding_window=True, sliding_window=16, max_window_layers=depth, layer_types=kinds,
        architectures=["Qwen2MoeForCausalLM"]).save_pretrained(folder)
    source = resolve_model(str(folder))
    full, _ = build_trained_model(source, False, None)
    plan = shallow_plan(full.config, full)
    whole = trace_activations(to_fake(full), library="transformers", batch_size=2, seq_len=48, precision_mode="fp32",
                              device_type="cpu")
    if plan is None:  # every kind shows only near the end: traced in full
        return
    short, _ = build_trained_model(source, False, None, config=plan.config)
    assert builds_the_prefix(plan, short)
    extrapolated = trace_activations(to_fake(short), library="transformers", batch_size=2, seq_len=48,
                                     precision_mode="fp32", device_type="cpu", layout=plan.layout)
    for field in FIELDS:
        # scalars the router makes now and then come to tens of bytes in megabytes; a block stood in for by
        # the wrong one is off by a percent (the first block standing for later ones: 0.8%)
        assert getattr(extrapolated, field) == pytest.approx(getattr(whole, field), rel=1e-4, abs=256), field


def test_a_cuda_target_without_any_sdpa_call_is_not_labelled_with_cpu_kernels(tmp_path):
    """A stack of Mamba blocks built with `sdpa` makes no SDPA call: for a CUDA target no kernel was stood in for,
    and the label says that instead of "CPU kernels" (which only a CPU target runs)."""
    import transformers

    transformers.BambaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128, vocab_size=300, attn_layer_indices=[], mamba_n_heads=8, mamba_d_head=16,
                             mamba_d_state=16, architectures=["BambaForCausalLM"]).save_pretrained(tmp_path)
    labels = {}
    for target in ("cuda", "cpu"):
        options = EstimateOptions(dtypes=("float32",), strategy="ddp", batch_size=2, seq_len=32, device_type=target,
                                  cuda_capability="9.0" if target == "cuda" else None)
        result = estimate(str(tmp_path), options)
        assert result.profile.activations.method == "traced"
        assert result.profile.activations.attention_kernels == []
        labels[target] = result.breakdown.attention
    assert labels == {"cuda": "sdpa (no SDPA call in the traced forward)", "cpu": "sdpa (CPU kernels)"}


def test_every_tensor_a_returned_cache_keeps_is_counted_layer_by_layer():
    """The loop's `outputs` keeps the model's cache alive until the next forward replaces it. An encoder-decoder
    returns an `EncoderDecoderCache`: two caches (self-attention, cross-attention) with a layer of each per decoder
    block, and no `layers` of its own; a linear-attention layer keeps conv and recurrent states, not keys and
    values. Every one of those tensors is found, joined per block."""
    import torch
    from transformers import DynamicCache, EncoderDecoderCache
    from transformers.cache_utils import LinearAttentionLayer

    from prefect_accelerate.memory.activations import _cache_layers

    own, cross = DynamicCache(), DynamicCache()
    for index in range(3):
        own.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), index)
        cross.update(torch.zeros(1, 2, 7, 4), torch.zeros(1, 2, 7, 4), index)
    layers = _cache_layers({"past_key_values": EncoderDecoderCache(own, cross)})
    assert [sorted(t.shape[2] for t in layer) for layer in layers] == [[5, 5, 7, 7]] * 3

    linear = LinearAttentionLayer()
    linear.conv_states[0], linear.recurrent_states[0] = torch.zeros(2, 8, 3), torch.zeros(2, 4, 16, 16)
    hybrid = DynamicCache()
    hybrid.layers = [linear, own.layers[0]]
    found = _cache_layers({"cache": hybrid})
    assert len(found) == 2
    assert {tuple(t.shape) for t in found[0]} >= {(2, 8, 3), (2, 4, 16, 16)}
    assert sorted(t.shape[2] for t in found[1]) == [5, 5]


def test_an_encoder_decoders_training_cache_is_held_by_the_loop_and_counted(tmp_path, train_and_measure):
    """T5 builds its `EncoderDecoderCache` in training (checkpointing turns it off) and returns it; the loop's
    `outputs` keeps the previous step's cache through the next forward, whose end is T5's peak here. Counted as
    no cache (the cache has no `layers` of its own), the estimate sat at 0.969 of the CPU allocator's peak
    (4 + 4 blocks, bench/memory_families_cpu.py's tiny config)."""
    import torch
    import transformers

    config = transformers.T5Config(d_model=128, d_ff=256, d_kv=32, num_heads=4, num_layers=2, num_decoder_layers=2,
                                   vocab_size=1000, decoder_start_token_id=0, pad_token_id=0, eos_token_id=0,
                                   tie_word_embeddings=False, architectures=["T5ForConditionalGeneration"])
    config.save_pretrained(tmp_path)
    result = estimate(str(tmp_path), EstimateOptions(dtypes=("float32",), strategy="ddp", batch_size=4, seq_len=128,
                                                     device_type="cpu"))
    model = transformers.T5ForConditionalGeneration._from_config(config).train()
    ids = torch.randint(1, 1000, (4, 128))
    cache = model(input_ids=ids, labels=ids, decoder_input_ids=ids).past_key_values
    real = sum(t.numel() * t.element_size() for s in (cache.self_attention_cache, cache.cross_attention_cache)
               for layer in s.layers for t in (layer.keys, layer.values))
    assert real > 0 and result.profile.activations.cache_bytes == real
    measured = train_and_measure(tmp_path, {"batch": 4, "seq": 128, "precision": "no", "checkpointing": False})
    ratio = result.breakdown.device_total_bytes / measured
    assert 0.98 <= ratio <= 1.05, ratio


def _real_checkpointed_rises(folder, architecture: str, batch: int, seq: int) -> list[int]:
    """Per block, in forward order: how far the CPU allocator's holding rose above the block's start during one
    real forward with transformers' gradient checkpointing (the allocator's own events, bracketed by hooks)."""
    import torch
    import transformers

    from prefect_accelerate.memory.measured import batch_for
    from prefect_accelerate.memory.probe import allocation_recorder

    torch.manual_seed(0)
    model = getattr(transformers, architecture)._from_config(transformers.AutoConfig.from_pretrained(folder)).train()
    model.gradient_checkpointing_enable()
    inputs = batch_for({"library": "transformers", "batch_size": batch, "seq_len": seq}, model, "cpu")
    marks: list = []

    def enter(*_) -> None:
        marks.append(torch.autograd.profiler.record_function("block"))
        marks[-1].__enter__()

    def leave(*_) -> None:
        marks.pop().__exit__(None, None, None)

    blocks = checkpoint_layers(model)
    for block in blocks:
        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave)
    with allocation_recorder() as recorder:
        model(**inputs)
    cpu = torch.autograd.DeviceType.CPU
    events = sorted((e for e in recorder.profiler.kineto_results.events() if e.name() == "[memory]"
                     and e.device_type() == cpu), key=lambda e: e.start_ns())
    begin = recorder.profiler.kineto_results.trace_start_ns()
    held, timeline = 0, []
    for event in events:
        held += event.nbytes()
        timeline.append(((event.start_ns() - begin) / 1000, held))
    spans = sorted((f.time_range.start, f.time_range.end) for f in recorder.events() if f.name == "block")
    assert len(spans) == len(blocks)
    rises = []
    for start, end in spans:
        before = next((h for t, h in reversed(timeline) if t < start), 0)
        rises.append(max((h for t, h in timeline if start <= t <= end), default=before) - before)
    return rises


@pytest.mark.parametrize("family", ["longt5", "llama"])
def test_a_checkpointed_forward_rises_block_by_block_as_the_second_fake_forward_measures(tmp_path, family):
    """Checkpointing keeps none of a block's saved tensors in the forward, so a block rises by its temporaries and
    its output, not by what it saves. The trace keeps every saved tensor (backward needs them), so it runs a second
    forward on fake tensors whose saved-tensor hooks keep nothing. Its per-block rises are held to the CPU
    allocator's own, block by block, in a real checkpointed forward; LongT5 at 512 tokens is where the old bound
    (the traced forward's largest rise, saved tensors included) sat far above it."""
    import transformers

    if family == "longt5":
        transformers.LongT5Config(d_model=64, d_kv=32, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=2,
                                  vocab_size=500, architectures=["LongT5ForConditionalGeneration"]).save_pretrained(tmp_path)
    else:
        transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
                                 num_key_value_heads=2, vocab_size=500, max_position_embeddings=512, bos_token_id=0,
                                 eos_token_id=0, pad_token_id=0, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    architecture = transformers.AutoConfig.from_pretrained(tmp_path).architectures[0]
    acts, _ = traced(tmp_path, batch_size=2, seq_len=512, device_type="cpu", gradient_checkpointing=True)
    real = _real_checkpointed_rises(tmp_path, architecture, 2, 512)
    assert len(acts.block_checkpointed_rises) == len(real)
    for fake, measured in zip(acts.block_checkpointed_rises, real, strict=True):
        assert abs(fake - measured) <= 0.02 * measured + 4096, (acts.block_checkpointed_rises, real)
    if family == "longt5":
        assert max(real) < 0.8 * acts.block_forward_rise_bytes  # what the old bound took for each block


def test_under_checkpointing_the_trace_follows_the_models_own_checkpointing_code(tmp_path):
    """T5's attention, when checkpointing is on, makes the position bias of a block without a learned one (the
    decoder's cross-attention) a tensor that requires grad, so the blocks that take it make it a gradient too. The
    trace turns the model's own checkpointing switches on (the blocks still run whole), so that gradient is
    measured: one more position bias waits in the decoder's backward and stays, as that tensor's .grad, through
    the encoder's; without checkpointing nothing changes."""
    import transformers

    transformers.T5Config(d_model=64, d_kv=32, d_ff=128, num_layers=3, num_decoder_layers=3, num_heads=2, vocab_size=500,
                          architectures=["T5ForConditionalGeneration"]).save_pretrained(tmp_path)
    bias = 1 * 2 * 256 * 256 * 4
    plain, _ = traced(tmp_path, batch_size=2, seq_len=256, device_type="cpu")
    checkpointed, _ = traced(tmp_path, batch_size=2, seq_len=256, device_type="cpu", gradient_checkpointing=True)
    extra = [c - p for c, p in zip(checkpointed.block_backward_waiting_bytes, plain.block_backward_waiting_bytes, strict=True)]
    assert extra[3:5] == [bias, bias] and all(e >= bias for e in extra[:3]), extra
    assert plain.block_backward_waiting_bytes[:3] == [bias, bias, 0]
