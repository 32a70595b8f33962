"""The estimate for sharded layouts against real FSDP and DDP runs: 2 processes on CPU (gloo), on loopback.

`estimate-memory --strategy fsdp_full_shard --num_processes 2` models one device of a sharded layout; the
probe (`--measure`) runs one process, so it cannot measure that. This bench runs the real layout: a tiny
Llama (written locally: 4 blocks, width 256, 1,000-token vocabulary) trained for 3 AdamW steps of
Accelerate's loop under `torch.distributed.run` with 2 processes and gloo, wrapped as Accelerate wraps it
(one unit per decoder block, the root for the rest):

- `ddp`: `DistributedDataParallel` (gradient buckets);
- `fsdp_full_shard`, `fsdp_shard_grad_op`: FSDP1 (`FullyShardedDataParallel`, `use_orig_params=True`),
  Accelerate's default `fsdp_version: 1`, which is what the estimate's bookkeeping follows;
- `fsdp2`: `fully_shard` per block and on the root (Accelerate's `fsdp_version: 2`), compared with the
  `fsdp_full_shard` estimate;
- `zero1`, `zero2`, `zero3`: `deepspeed.initialize` as Accelerate's plugin configures it without a JSON file (the stage,
  bf16 when asked, DeepSpeed's defaults for the rest, the script's torch AdamW as client optimizer), on
  DeepSpeed's CPU accelerator (its shared-memory op left uncompiled: gloo does that work).

Each rank measures its own peak with the probe's CPU allocator recorder (memory/probe.py), from after the
model is wrapped (so the unsharded model each process builds first on CPU, which a GPU never holds, is not
counted) plus the shards it keeps, twice: whole, and without the blocks allocated inside a c10d collective
op (gloo's own copies, which NCCL does not make in PyTorch's allocator). Each layout runs `--repeats` times;
the table gives the estimate, the lowest and highest per-rank peak, both ratios, and the highest peak without
gloo's copies with its ratio. Gloo's collectives allocate on its own threads, so the
per-rank peak varies from run to run by a few units of one block's weights: that spread is printed, not
smoothed. Nothing here passes or fails; no GPU is involved.

    python bench/memory_sharded_cpu.py              # 7 layouts x 3 runs: about 6 minutes on 2 cores
    python bench/memory_sharded_cpu.py --repeats 5 --only fsdp_full_shard
    python bench/memory_sharded_cpu.py --only zero2 --only zero3 --reduce_bucket_size 2000000 --overlap_comm on
    python bench/memory_sharded_cpu.py --only zero2 --only zero3 --accelerate_auto   # "auto" sizes, as Accelerate fills them

`--family MODEL_TYPE` runs any transformers family instead of the tiny Llama: the tiny config
bench/memory_families_cpu.py builds (width 128, 4 blocks, the family's other defaults), its causal-LM head
(else seq2seq, else masked-LM), and FSDP units of the classes its `_no_split_modules` names, as Accelerate
picks them (an encoder-decoder's encoder and decoder blocks, a mixture-of-experts block with its experts).

    python bench/memory_sharded_cpu.py --family t5 --repeats 2
    python bench/memory_sharded_cpu.py --family mixtral --only fsdp_full_shard --only zero3

With DeepSpeed's default 5e8-element reduce bucket, the bucket is nearly all of a ZeRO rank's peak on this
model; a small `--reduce_bucket_size` lets the rest (partitioned states, gathered weights, activations) show.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "shims"))  # torchvision shim (CPU torch beside a CUDA torchvision wheel)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LAYOUTS = {"ddp": "ddp", "fsdp_full_shard": "fsdp_full_shard", "fsdp_shard_grad_op": "fsdp_shard_grad_op",
           "fsdp2": "fsdp_full_shard", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3"}  # layout run -> strategy estimated
BATCH, SEQ, STEPS, PROCESSES = 4, 128, 3, 2


def write_config(folder: Path, family: str | None = None) -> Path:
    """The bench's model as a config folder: the tiny Llama, or a tiny config of ``family`` (a transformers
    model_type: its causal-LM head, else its sequence-to-sequence one, else its masked-LM one) built as
    bench/memory_families_cpu.py builds it, with 4 blocks so that sharding has units to spread."""
    import transformers

    if family:
        from memory_families_cpu import families, tiny_config

        heads = {model_type: architecture for _, model_type, architecture in reversed(families(["masked", "seq2seq", "causal"]))}
        if family not in heads:
            raise SystemExit(f"--family {family}: transformers has no causal-LM, seq2seq or masked-LM head of that model_type")
        tiny_config(family, heads[family], depth=4).save_pretrained(folder)
        return folder
    transformers.LlamaConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
        vocab_size=1000, max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    return folder


def rank_peak(folder: str, layout: str, precision: str) -> dict:
    """In each process of the launch: wrap, train, and return this rank's allocator peak. ``precision`` "bf16":
    autocast, and for FSDP 16-bit gathered weights and reductions (Accelerate's FSDP mixed-precision policy)."""
    import functools
    import gc

    import torch
    import torch.distributed as dist
    import transformers

    from prefect_accelerate.memory.measured import batch_for, train_step
    from prefect_accelerate.memory.probe import allocation_recorder

    dist.init_process_group("gloo")
    config = transformers.AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    model = getattr(transformers, config.architectures[0])._from_config(config).train()
    blocks = block_classes(model)
    half = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16} if precision == "bf16" else None
    if layout == "ddp":
        # a family whose head leaves a weight out of the loss (BERT's masked-LM head) trains under DDP only with
        # find_unused_parameters=True (Accelerate: DistributedDataParallelKwargs). DDP then never rebuilds its
        # gradient buckets (reducer.cpp, `should_rebuild_buckets`), so the ones it made when wrapping, before the
        # recorder starts, are the ones it keeps: counted here. Without it they are rebuilt in the second forward,
        # in the recorder's view.
        unused = leaves_weights_out(model, precision)
        model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=unused)
        local = list(model.parameters())
        if unused:
            local += [p for p in local if p.requires_grad]  # the buckets: one copy of every trained weight
    elif layout == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = {"mp_policy": MixedPrecisionPolicy(**half)} if half else {}
        for layer in [module for module in model.modules() if type(module) in blocks]:
            fully_shard(layer, **policy)
        fully_shard(model, **policy)
        local = [p.to_local() for p in model.parameters()]
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        strategy = ShardingStrategy.FULL_SHARD if layout == "fsdp_full_shard" else ShardingStrategy.SHARD_GRAD_OP
        model = FullyShardedDataParallel(
            model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=blocks),
            sharding_strategy=strategy, device_id=torch.device("cpu"), use_orig_params=True,
            mixed_precision=MixedPrecision(**half, buffer_dtype=torch.bfloat16) if half else None)
        local = list(model.parameters())
    kept_bytes = sum(p.numel() * p.element_size() for p in local) + sum(b.numel() * b.element_size() for b in model.buffers())
    gc.collect()
    case = {"library": "transformers", "batch_size": BATCH, "seq_len": SEQ, "mixed_precision": precision}
    recorder = allocation_recorder()
    with recorder:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        inputs = batch_for(case, model.module if layout == "ddp" else model, "cpu")
        kept: dict = {}
        for _ in range(STEPS):
            train_step(case, model, optimizer, inputs, "cpu", kept)
        del kept, optimizer
    peaks = _peaks(recorder)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return {"rank": rank, **{name: value + kept_bytes for name, value in peaks.items()}}


def leaves_weights_out(model, precision: str) -> bool:  # noqa: ANN001
    """Whether a training step of the bench's batch leaves a trained weight without a gradient (measured: one
    forward and backward, then the gradients are dropped)."""
    from prefect_accelerate.memory.measured import batch_for, train_step

    class _NoStep:
        def step(self) -> None:
            pass

        def zero_grad(self, set_to_none: bool = True) -> None:
            pass

    case = {"library": "transformers", "batch_size": BATCH, "seq_len": SEQ, "mixed_precision": precision}
    train_step(case, model, _NoStep(), batch_for(case, model, "cpu"), "cpu")
    unused = any(p.grad is None for p in model.parameters() if p.requires_grad)
    model.zero_grad(set_to_none=True)
    return unused


def block_classes(model) -> set:  # noqa: ANN001
    """The classes FSDP wraps as units, as Accelerate picks them: the model's `_no_split_modules`
    (`fsdp_transformer_layer_cls_to_wrap` defaults to them), found among its modules."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return {type(module) for module in model.modules() if type(module).__name__ in names}


def _peaks(recorder, started: int | None = None) -> dict:
    """The rank's allocator peak from ``started`` on (time.time_ns; None: from the start, with nothing held before),
    and the same peak without the blocks allocated inside a c10d collective op (``c10d::*``): gloo's own copies,
    such as the clone ``_reduce_scatter_base_`` makes of its whole input and keeps until the work object goes,
    which NCCL does not make in PyTorch's allocator. Each allocation is matched to its free by address."""
    from torch._C._profiler import _EventType

    allocations = []

    def walk(node, inside: bool) -> None:
        if node.tag == _EventType.TorchOp and node.name.startswith("c10d::"):
            inside = True
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            allocations.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size, inside))
        for child in node.children:
            walk(child, inside)

    for root in recorder.profiler.kineto_results.experimental_event_tree():
        walk(root, False)
    allocations.sort(key=lambda allocation: allocation[0])
    collective: set[int] = set()
    held = held_outside = 0
    peak = peak_outside = None if started is not None else 0
    for time_ns, ptr, size, inside in allocations:
        if peak is None and time_ns >= started:
            peak, peak_outside = held, held_outside  # what lives on the device once set-up is done
        if size > 0 and inside:
            collective.add(ptr)
        skip = ptr in collective
        if size < 0:
            collective.discard(ptr)
        held += size
        held_outside += 0 if skip else size
        if peak is not None:
            peak, peak_outside = max(peak, held), max(peak_outside, held_outside)
    return {"peak": int(peak or 0), "peak_outside_collectives": int(peak_outside or 0)}


def zero_rank_peak(folder: str, layout: str, precision: str, bucket: str = "default", overlap: str = "default",
                   auto: str = "off") -> dict:
    """In each process of a DeepSpeed launch: `deepspeed.initialize` with Accelerate's plugin defaults (the stage,
    bf16 when asked, DeepSpeed's own defaults for the rest, a torch AdamW as the client optimizer), train, and
    return this rank's allocator peak from the end of `initialize` on (the fp32 model every process builds first
    on CPU is never on the device)."""
    import gc
    import importlib
    import time

    import torch
    import transformers

    # DeepSpeed's shared-memory all-reduce op would be compiled first (minutes); gloo does its work here
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed

    from prefect_accelerate.memory.measured import batch_for, train_step
    from prefect_accelerate.memory.probe import allocation_recorder

    deepspeed.init_distributed(dist_backend="gloo")
    config = transformers.AutoConfig.from_pretrained(folder)
    settings = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": int(layout[-1])}}
    if bucket != "default":
        settings["zero_optimization"]["reduce_bucket_size"] = int(bucket)
    if overlap != "default":
        settings["zero_optimization"]["overlap_comm"] = overlap == "on"
    if auto == "on":  # "auto" in the JSON for the three sizes Accelerate fills in from hidden_size (_prepare_deepspeed)
        hidden = config.hidden_size
        settings["zero_optimization"].update({"reduce_bucket_size": hidden * hidden,
                                              "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
                                              "stage3_param_persistence_threshold": 10 * hidden})
    if precision == "bf16":
        settings["bf16"] = {"enabled": True}
    case = {"library": "transformers", "batch_size": BATCH, "seq_len": SEQ, "mixed_precision": "no"}  # no autocast
    torch.manual_seed(0)
    recorder = allocation_recorder()
    with recorder:
        model = getattr(transformers, config.architectures[0])._from_config(config).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=settings)
        del model, optimizer
        gc.collect()
        started = time.time_ns()  # the profiler stamps its events with the same clock
        inputs = batch_for(case, engine.module, "cpu")
        kept: dict = {}
        for _ in range(STEPS):
            kept["outputs"] = None
            kept["outputs"] = engine(**inputs)
            engine.backward(kept["outputs"].loss)
            engine.step()
        del kept
    peaks = _peaks(recorder, started)
    rank = torch.distributed.get_rank()
    torch.distributed.destroy_process_group()
    return {"rank": rank, **peaks}


def free_port() -> int:
    from prefect_accelerate.launchers.ports import rendezvous_port

    return rendezvous_port("127.0.0.1")


def launch(folder: Path, layout: str, precision: str, zero: tuple[str, ...] = ("default", "default", "off")) -> list[dict]:
    """One run of the layout under torch.distributed.run; each rank's peaks (see `_peaks`), by rank."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(PROCESSES),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), __file__, "--child", str(folder), layout, precision,
               *(zero if layout.startswith("zero") else ())]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    # the ranks share one stdout, so two lines can run together: decode each object where it starts
    decoder = json.JSONDecoder()
    rows = [decoder.raw_decode(done.stdout, start)[0] for start in
            (found.start() for found in re.finditer(r'\{"rank"', done.stdout))]
    if done.returncode != 0 or len(rows) != PROCESSES:
        raise SystemExit(f"{layout}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return sorted(rows, key=lambda row: row["rank"])


def estimated(folder: Path, strategy: str, precision: str, zero: tuple[str, ...] = ("default", "default", "off")) -> int:
    from prefect_accelerate.memory import EstimateOptions, estimate

    options = EstimateOptions(dtypes=("float32",), strategy=strategy, num_processes=PROCESSES, batch_size=BATCH,
                              seq_len=SEQ, device_type="cpu", mixed_precision=precision,
                              reduce_bucket_size="auto" if zero[2] == "on" else None if zero[0] == "default" else int(zero[0]),
                              prefetch_bucket_size="auto" if zero[2] == "on" else None,
                              overlap_comm=None if zero[1] == "default" else zero[1] == "on")
    return estimate(str(folder), options).breakdown.device_total_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", action="append", choices=sorted(LAYOUTS), default=[])
    parser.add_argument("--mixed_precision", choices=("no", "bf16"), default="no")
    parser.add_argument("--out", help="append each layout's figures as a JSON line here")
    parser.add_argument("--reduce_bucket_size", default="default",
                        help="ZeRO layouts: DeepSpeed's reduce_bucket_size (elements), in the run and the estimate")
    parser.add_argument("--overlap_comm", choices=("default", "on", "off"), default="default",
                        help="ZeRO layouts: DeepSpeed's overlap_comm, in the run and the estimate")
    parser.add_argument("--accelerate_auto", action="store_true",
                        help="ZeRO layouts: reduce_bucket_size, stage3_prefetch_bucket_size and stage3_param_persistence_"
                             "threshold \"auto\", as Accelerate fills them in from hidden_size (replaces --reduce_bucket_size)")
    parser.add_argument("--family", help="a transformers model_type to run instead of the tiny Llama (a tiny config of it, "
                                         "4 blocks, as bench/memory_families_cpu.py builds it)")
    parser.add_argument("--child", nargs="+", metavar="ARG", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import sitecustomize  # noqa: F401 - the torchvision shim

        run = zero_rank_peak if args.child[1].startswith("zero") else rank_peak
        print(json.dumps(run(*args.child)), flush=True)
        return
    os.environ.setdefault("PREFECT_ACCELERATE_PROFILE_CACHE", "off")
    with tempfile.TemporaryDirectory(prefix="sharded-") as tmp:
        folder = write_config(Path(tmp), args.family)
        print(f"tiny {args.family or 'Llama'}, {PROCESSES} processes (gloo, CPU), batch {BATCH} x {SEQ}, {args.mixed_precision}, {STEPS} AdamW steps, "
              f"{args.repeats} runs per layout; MB = 1e6 bytes")
        print("peak: each rank's allocator peak; w/o gloo: the same without the blocks gloo allocates inside c10d "
              "collectives (NCCL makes no such copies in PyTorch's allocator)")
        print(f"{'layout':20s} {'estimate':>9s} {'lowest':>8s} {'median':>8s} {'highest':>8s}  est/lowest est/highest"
              f"  {'highest w/o gloo':>16s} est/that")
        for layout in args.only or list(LAYOUTS):
            zero = ((args.reduce_bucket_size, args.overlap_comm, "on" if args.accelerate_auto else "off")
                    if layout.startswith("zero") else ("default", "default", "off"))
            figure = estimated(folder, LAYOUTS[layout], args.mixed_precision, zero)
            ranks = [rank for _ in range(args.repeats) for rank in launch(folder, layout, args.mixed_precision, zero)]
            peaks = [rank["peak"] for rank in ranks]
            outside = [rank["peak_outside_collectives"] for rank in ranks]
            low, mid, high = min(peaks), statistics.median(peaks), max(peaks)
            print(f"{layout:20s} {figure / 1e6:9.2f} {low / 1e6:8.2f} {mid / 1e6:8.2f} {high / 1e6:8.2f}  "
                  f"{figure / low:10.3f} {figure / high:11.3f}  {max(outside) / 1e6:16.2f} {figure / max(outside):8.3f}",
                  flush=True)
            if args.out:
                with open(args.out, "a") as out:
                    out.write(json.dumps({"layout": layout, "estimated_as": LAYOUTS[layout], "estimate": figure,
                                          "rank_peaks": peaks, "rank_peaks_outside_collectives": outside,
                                          **({"family": args.family} if args.family else {}), "processes": PROCESSES, "batch": BATCH, "seq": SEQ,
                                          "mixed_precision": args.mixed_precision,
                                          **({"reduce_bucket_size": "auto" if zero[2] == "on" else zero[0], "overlap_comm": zero[1]}
                                             if layout.startswith("zero") else {})})
                          + "\n")


if __name__ == "__main__":
    main()
