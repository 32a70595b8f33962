"""Estimate / measured on a real CUDA device, for a grid of models and layouts; writes data the tests consume.

Each case trains 3 AdamW steps (torch's default foreach implementation) with Accelerate's example loop,
`out = model(**batch)`, `out.loss.backward()`, `opt.step()`, `opt.zero_grad(set_to_none=True)`, bf16
through `torch.autocast`, the model built from its config on the GPU, in a fresh process (so one case's
cached blocks or out-of-memory error cannot change the next). Measured: `torch.cuda.max_memory_allocated`
and `max_memory_reserved`, and the memory used outside PyTorch's allocator (CUDA context, handles);
for a run that runs out of memory, what was allocated and reserved when it failed.

Needs torch (with CUDA), transformers and timm only: no prefect, no pydantic. Where the estimator can
also be imported (pydantic installed), each row also prints estimate / measured; otherwise run
`python bench/memory_accuracy_cuda.py --compare FILE` on any machine with the package installed.

    python bench/memory_accuracy_cuda.py --out tests/data/memory_gpu_<gpu>.json            # the whole grid
    python bench/memory_accuracy_cuda.py --only gpt2 --only llama-1b --out /tmp/some.json  # a subset
    python bench/memory_accuracy_cuda.py --list
    python bench/memory_accuracy_cuda.py --compare tests/data/memory_gpu_h200.json         # CPU: estimates only

Commit the file under tests/data/ (name it memory_gpu_<gpu>.json); tests/memory/test_mem_gpu_measured.py
then holds every estimate to within 10% of the allocated peaks, in CI, without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from prefect_accelerate.memory.measured import GIB, batch_for, build_model, load_cases, train_step  # noqa: E402

STEPS = 3
TOKENS = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
LLAMA_1B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 16,
            "intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000, **TOKENS}
LLAMA_3B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 3200, "num_hidden_layers": 26,
            "intermediate_size": 8640, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000, **TOKENS}
LLAMA_7B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
            "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
            "max_position_embeddings": 4096, **TOKENS}
GPT2_MEDIUM = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 24, "n_embd": 1024, "n_head": 16}
BERT_LARGE = {"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 1024, "num_hidden_layers": 24,
              "num_attention_heads": 16, "intermediate_size": 4096}
T5_LARGE = {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_model": 1024, "d_ff": 4096, "num_layers": 24,
            "num_decoder_layers": 24, "num_heads": 16, "d_kv": 64, "decoder_start_token_id": 0}
LLAMA_HD90 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2880, "num_hidden_layers": 16,
              "intermediate_size": 6912, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, **TOKENS}
GPT2_HD68 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 12, "n_embd": 1088, "n_head": 16}
BART_LARGE = {"model_type": "bart", "architectures": ["BartForConditionalGeneration"], "d_model": 1024, "encoder_layers": 12,
              "decoder_layers": 12, "encoder_attention_heads": 16, "decoder_attention_heads": 16, "encoder_ffn_dim": 4096,
              "decoder_ffn_dim": 4096, "vocab_size": 50265, "max_position_embeddings": 1024, "decoder_start_token_id": 2}
LLAMA_1B_LONG = {**LLAMA_1B, "max_position_embeddings": 16384}
VIT_B = {"architecture": "vit_base_patch16_224", "num_classes": 1000}
VIT_L = {"architecture": "vit_large_patch16_224", "num_classes": 1000}


def _case(name, library, config, precision, batch, seq=None, attn=None, checkpointing=False):  # noqa: ANN001, ANN202
    return {"name": name, "library": library, "config": config, "mixed_precision": precision, "batch_size": batch,
            "seq_len": seq, "attn_implementation": attn, "gradient_checkpointing": checkpointing}


def grid() -> list[dict]:
    """Decoder, encoder, encoder-decoder (T5's learned bias, BART) and a timm ViT; fp32/bf16; sdpa/eager; head dims
    that are not multiples of 8 (100, 90, 68); grouped keys/values; checkpointing; 16k-token sequences."""
    t, m = "transformers", "timm"
    return [
        _case("llama-1.1b-shape fp32 4x1024", t, LLAMA_1B, "no", 4, 1024),
        _case("llama-1.1b-shape bf16 4x1024", t, LLAMA_1B, "bf16", 4, 1024),
        _case("llama-1.1b-shape bf16 4x1024 eager", t, LLAMA_1B, "bf16", 4, 1024, "eager"),
        _case("llama-1.1b-shape bf16 16x2048 checkpointing", t, LLAMA_1B, "bf16", 16, 2048, checkpointing=True),
        _case("llama-3b-shape bf16 4x2048", t, LLAMA_3B, "bf16", 4, 2048),
        _case("llama-3b-shape fp32 2x2048 checkpointing", t, LLAMA_3B, "no", 2, 2048, checkpointing=True),
        _case("llama-2-7b-shape bf16 1x4096", t, LLAMA_7B, "bf16", 1, 4096),
        _case("llama-2-7b-shape bf16 1x2048 checkpointing", t, LLAMA_7B, "bf16", 1, 2048, checkpointing=True),
        _case("gpt2-medium fp32 8x1024 sdpa (default)", t, GPT2_MEDIUM, "no", 8, 1024),
        _case("gpt2-medium fp32 8x1024 eager", t, GPT2_MEDIUM, "no", 8, 1024, "eager"),
        _case("gpt2-medium bf16 16x1024", t, GPT2_MEDIUM, "bf16", 16, 1024),
        _case("gpt2-medium fp32 16x1024 checkpointing", t, GPT2_MEDIUM, "no", 16, 1024, checkpointing=True),
        _case("bert-large fp32 16x512", t, BERT_LARGE, "no", 16, 512),
        _case("bert-large fp32 16x512 eager", t, BERT_LARGE, "no", 16, 512, "eager"),
        _case("bert-large bf16 32x512", t, BERT_LARGE, "bf16", 32, 512),
        _case("t5-large fp32 8x512", t, T5_LARGE, "no", 8, 512),
        _case("t5-large bf16 16x512", t, T5_LARGE, "bf16", 16, 512),
        _case("llama-3b-shape bf16 2x2048 checkpointing", t, LLAMA_3B, "bf16", 2, 2048, checkpointing=True),
        _case("llama-hd90 gqa bf16 4x2048", t, LLAMA_HD90, "bf16", 4, 2048),
        _case("llama-hd90 gqa fp32 2x2048", t, LLAMA_HD90, "no", 2, 2048),
        _case("llama-1.1b-shape bf16 1x16384 long", t, LLAMA_1B_LONG, "bf16", 1, 16384),
        _case("llama-1.1b-shape bf16 1x16384 long checkpointing", t, LLAMA_1B_LONG, "bf16", 1, 16384, checkpointing=True),
        _case("gpt2-hd68 fp32 8x1024", t, GPT2_HD68, "no", 8, 1024),
        _case("gpt2-hd68 bf16 8x1024", t, GPT2_HD68, "bf16", 8, 1024),
        _case("t5-large bf16 16x512 checkpointing", t, T5_LARGE, "bf16", 16, 512, checkpointing=True),
        _case("t5-large fp32 8x512 eager", t, T5_LARGE, "no", 8, 512, "eager"),
        _case("bart-large fp32 8x1024", t, BART_LARGE, "no", 8, 1024),
        _case("bart-large bf16 16x1024", t, BART_LARGE, "bf16", 16, 1024),
        _case("vit-b16 fp32 batch 64", m, VIT_B, "no", 64),
        _case("vit-l16 bf16 batch 64", m, VIT_L, "bf16", 64),
    ]


def measure_one(case: dict, steps: int) -> dict:  # pragma: no cover - CUDA machines only
    """Train the case on cuda:0 in this process; the measured fields of the case."""
    import torch

    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    result: dict = {}
    try:
        model = build_model(case, "cuda")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        batch = batch_for(case, model, "cuda")
        kept: dict = {}  # the loop's `outputs`: alive until the next forward replaces them
        for _ in range(steps):
            train_step(case, model, optimizer, batch, "cuda", kept)
        torch.cuda.synchronize()
        kept.clear()
        result.update(outcome="ok", allocated_peak_gib=torch.cuda.max_memory_allocated() / GIB,
                      reserved_peak_gib=torch.cuda.max_memory_reserved() / GIB)
        attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if attention:
            result["attention_run"] = attention
    except torch.OutOfMemoryError as error:
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        result.update(outcome="out of memory", allocated_at_failure_gib=allocated / GIB,
                      reserved_unallocated_at_failure_gib=(reserved - allocated) / GIB,
                      failed_allocation_mib=_tried_mib(str(error)), error=str(error).splitlines()[0][:300])
    free, total = torch.cuda.mem_get_info()
    result["outside_allocator_gib"] = (total - free - torch.cuda.memory_reserved()) / GIB
    return result


def _tried_mib(message: str) -> float | None:
    import re

    found = re.search(r"Tried to allocate ([\d.]+) (MiB|GiB|KiB)", message)
    if not found:
        return None
    return float(found.group(1)) * {"KiB": 1 / 1024, "MiB": 1, "GiB": 1024}[found.group(2)]


def provenance() -> dict:  # pragma: no cover - CUDA machines only
    import torch
    import transformers

    props = torch.cuda.get_device_properties(0)
    try:
        import timm

        timm_version = timm.__version__
    except ImportError:
        timm_version = None
    return {
        "gpu": props.name, "device_memory_gib": round(props.total_memory / GIB, 2), "torch": torch.__version__,
        "compute_capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(), "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}",
        "hardware_measured": True,
        "transformers": transformers.__version__, "timm": timm_version,
        "loop": (f"models built from configs on the GPU (fp32 weights); AdamW (torch's default foreach); {STEPS} steps of "
                 "`out = model(**batch)`, `out.loss.backward()`, `opt.step()`, `opt.zero_grad(set_to_none=True)`; bf16 "
                 "through `torch.autocast` around forward and loss; one fresh process per case"),
        "source": f"bench/memory_accuracy_cuda.py, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
    }


def estimates_for(cases: list[dict], device_memory_gib: float) -> list[tuple[float, float | None, str]] | None:
    """(estimate GiB, allocator need GiB, verdict status) per case, or None where the estimator cannot be imported."""
    try:
        from prefect_accelerate.memory import check_fit, estimate
        from prefect_accelerate.memory.measured import case_options, write_config
    except ImportError as error:
        print(f"(estimates skipped: {error}; run --compare FILE where the package is installed)")
        return None
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, case in enumerate(cases):
            result = estimate(str(write_config(case, Path(tmp) / str(index))), case_options(case))
            verdict = check_fit(result, int(device_memory_gib * GIB))
            rows.append((result.breakdown.device_total_bytes / GIB, verdict.required_bytes / GIB,
                         f"{verdict.status}; {result.breakdown.attention or '-'}"))
    return rows


def report(prov: dict, cases: list[dict]) -> None:
    print(f"{prov['gpu']} ({prov['device_memory_gib']} GiB), torch {prov['torch']}, transformers {prov['transformers']}")
    rows = estimates_for(cases, prov["device_memory_gib"])
    header = f"{'case':<46} {'measured alloc':>14} {'reserved':>9} {'estimate':>9} {'est/meas':>8} {'need':>8} {'need/res':>8}  verdict"
    print(header)
    print("-" * len(header))
    ratios = []
    for index, case in enumerate(cases):
        est, need, status = rows[index] if rows else (None, None, "")
        if case["outcome"] == "ok":
            measured, reserved = case["allocated_peak_gib"], case.get("reserved_peak_gib")
            ratio = est / measured if est else None
            if ratio:
                ratios.append(ratio)
            print(f"{case['name']:<46} {measured:>14.2f} {reserved or float('nan'):>9.2f} {est or float('nan'):>9.2f} "
                  f"{ratio or float('nan'):>8.3f} {need or float('nan'):>8.2f} "
                  f"{(need / reserved) if need and reserved else float('nan'):>8.3f}  {status}")
        else:
            print(f"{case['name']:<46} {'OOM at ' + format(case['allocated_at_failure_gib'], '.2f'):>14} "
                  f"{'':>9} {est or float('nan'):>9.2f} {'':>8} {need or float('nan'):>8.2f} {'':>8}  {status}")
    if ratios:
        print(f"\nestimate / measured allocated peak: min {min(ratios):.3f}, max {max(ratios):.3f} (aim: 0.90-1.10)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the measurements here (JSON, tests/data format)")
    parser.add_argument("--only", action="append", default=[], help="cases whose name contains this (repeatable)")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--list", action="store_true", help="print the grid and exit")
    parser.add_argument("--compare", type=Path, help="print estimate / measured for a committed file (no GPU needed)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one JSON case in this process
    args = parser.parse_args(argv)

    if args.one:  # pragma: no cover - CUDA machines only
        print(json.dumps(measure_one(json.loads(args.one), args.steps)))
        return 0
    if args.compare:
        sys.path.insert(0, str(REPO / "tests" / "shims"))  # a no-op where torchvision imports cleanly
        import sitecustomize  # noqa: F401
        prov, cases = load_cases(args.compare)
        report(prov, cases)
        return 0
    cases = [c for c in grid() if not args.only or any(o in c["name"] for o in args.only)]
    if args.list:
        print("\n".join(c["name"] for c in cases))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("No CUDA device here. Run this on a GPU machine, or use --compare FILE to see committed measurements.")
        return 2
    measured = []  # pragma: no cover - CUDA machines only
    for case in cases:  # pragma: no cover
        child = subprocess.run([sys.executable, __file__, "--one", json.dumps(case), "--steps", str(args.steps)],
                               capture_output=True, text=True, timeout=900)
        lines = child.stdout.strip().splitlines()
        if child.returncode != 0 or not lines:
            print(f"{case['name']}: failed (exit {child.returncode}): {child.stderr.strip().splitlines()[-1:]}")
            continue
        measured.append({**case, **json.loads(lines[-1])})
        print(f"measured {case['name']}: {measured[-1]}", flush=True)
    prov = provenance()  # pragma: no cover
    data = {"schema": 1, "provenance": prov, "cases": measured}
    if args.out:  # pragma: no cover
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(args.out)
        print(f"wrote {args.out}")
    report(prov, measured)  # pragma: no cover
    return 0


if __name__ == "__main__":
    sys.exit(main())
