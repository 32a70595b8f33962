"""Estimate / measured peak on CPU for every model family transformers ships with a training head.

The memory gate must hold on models nobody tuned it to. This walks transformers' own registry of
architectures (the causal-LM, masked-LM and sequence-to-sequence heads: about 290 families in
transformers 5.25), builds a tiny config of each (the family's defaults with 2 blocks, width 128, 4
heads, a 1,000-token vocabulary), and compares `estimate-memory`'s figure (`device_type="cpu"`: CPU's own
kernels, since that is what runs here) with the peak PyTorch's CPU allocator reports over 3 real AdamW
steps of Accelerate's example loop (memory/probe.py's recorder, the one `--measure` uses). Three runs per
family: fp32, bf16 autocast, and fp32 with gradient checkpointing; batch 4 x 128 tokens.

Each family runs in a child process of its own, with a 5 GiB cap on its resident memory (a family whose
CPU path is quadratic in something stops there, not the machine). A family transformers itself cannot
build or train from such a config (a config that needs more than these fields, a sub-model with its own
config) is reported as skipped with transformers' error; an estimate that raises is a finding.

    python bench/memory_families_cpu.py                         # every family: 30-60 minutes on 2 cores
    python bench/memory_families_cpu.py --only llama --only t5  # a few
    python bench/memory_families_cpu.py --heads causal --out /tmp/causal.jsonl
    python bench/memory_families_cpu.py --sample 40 --seed 1 --out /tmp/sample.jsonl  # 40 families at random

Prints one row per run and a summary: how many runs sit within 10% of the measured peak, the lowest and
highest ratio, and every run outside [0.90, 1.10]. Nothing here passes or fails; tests/memory holds a few
of these families to the 10% line in CI (test_mem_probe.py).

    python bench/memory_families_cpu.py --only bloom --batch 2 --seq 1024 --width 64 --attention_heads 2   # long sequences

Long sequences on a narrow model make the attention's seq x seq tensors most of the peak: what the model keeps of
them between blocks, and when its masks die, then decide the figure (docs/memory.md, "long sequences").

    python bench/memory_families_cpu.py --deep 9 --out /tmp/deep.jsonl   # shallow traces against full ones
    python bench/memory_families_cpu.py --blocks 9 --only jamba           # measured, 9 blocks (traced shallow)

`--deep N` builds each family with N blocks instead (the family's own rules then put its different kinds of
block where they go: experts from some depth on, attention every k-th block) and compares, without
training, the estimate from the shallow trace of memory/depth.py with the estimate from a trace of all N
blocks; a ratio other than 1.000 is a stack the shallow plan misrepresents. Minutes for every family.

    python bench/memory_families_cpu.py --cuda --out /tmp/cuda.jsonl     # the CUDA path on every family

`--cuda` estimates each family for a CUDA target (capability 9.0) and for CPU, without training: the trace
then takes CUDA's autocast policy, PyTorch's SDPA kernel rules and the kernels' own saved tensors, the path
a user with a GPU gets. No GPU is involved and nothing is measured; the ratio (CUDA / CPU estimate) only
shows how far the two paths part, and the findings are estimates that raise, or paths traced for CPU and
not for CUDA.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "shims"))  # torchvision shim (CPU torch beside a CUDA torchvision wheel)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

HEADS = {"causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "masked": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
         "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"}
VARIANTS = {"fp32": ("no", False), "bf16": ("bf16", False), "checkpointing": ("no", True)}
BATCH, SEQ = 4, 128
#: the depth fields, under every name families use (--deep sets them all)
DEPTHS = ("num_hidden_layers", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers")
RSS_CAP = 5 << 30
#: the size fields, under every name families use; a config class takes the ones its __init__ or
#: attribute_map knows, keeps its own defaults for the rest
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
            vocab_size=1000, max_position_embeddings=512, head_dim=32, d_model=128, d_ff=256, d_kv=32, num_heads=4,
            num_layers=2, num_decoder_layers=2, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256, n_positions=512, rotary_dim=16,
            bos_token_id=0, eos_token_id=0, pad_token_id=0, decoder_start_token_id=0, tie_word_embeddings=False)


def resize(width: int, heads: int, seq: int) -> None:
    """Another shape for every tiny config (--width, --attention_heads, longer --seq): the width under each name
    families use, its heads (each with its own keys and values), twice its width for the MLP, and positions for the
    sequence. Not called for the default shape, so the committed walks stay as they were built."""
    global TINY
    positions = max(512, seq)
    TINY = TINY | dict(hidden_size=width, d_model=width, num_attention_heads=heads, num_heads=heads, num_key_value_heads=heads,
                       encoder_attention_heads=heads, decoder_attention_heads=heads, head_dim=width // heads,
                       d_kv=width // heads, intermediate_size=2 * width, d_ff=2 * width, encoder_ffn_dim=2 * width,
                       decoder_ffn_dim=2 * width, max_position_embeddings=positions, n_positions=positions)


def families(heads: list[str]) -> list[tuple[str, str, str]]:
    """(head, model_type, architecture) for every registered family with one of these heads."""
    import transformers
    from transformers.models.auto import modeling_auto

    found = []
    for head in heads:
        for model_type, architecture in getattr(modeling_auto, HEADS[head]).items():
            architecture = architecture[0] if isinstance(architecture, (list, tuple)) else architecture
            if hasattr(transformers, architecture):
                found.append((head, model_type, architecture))
    return found


def tiny_config(model_type: str, architecture: str, depth: int = 2):  # noqa: ANN201
    import transformers

    cls = type(transformers.AutoConfig.for_model(model_type))
    accepted = set(inspect.signature(cls.__init__).parameters) | set(getattr(cls, "attribute_map", {}))
    sizes = TINY | {name: depth for name in DEPTHS}
    return cls(**{k: v for k, v in sizes.items() if k in accepted}, architectures=[architecture])


def _written(model_type: str, architecture: str, depth: int, prefix: str) -> tuple[Path | None, list[dict]]:
    """The family's tiny config saved in a fresh folder; or no folder and the skip row, when the family's config
    needs more than the size fields."""
    try:
        folder = Path(tempfile.mkdtemp(prefix=f"{prefix}-{model_type}-"))
        tiny_config(model_type, architecture, depth).save_pretrained(folder)
    except Exception as error:  # noqa: BLE001 - reported as the family's row
        return None, [{"family": model_type, "variant": "-", "skipped": f"config: {type(error).__name__}: {str(error)[:160]}"}]
    return folder, []


def _failed(row: dict, error: Exception, where: str = "") -> None:
    """An estimate that raised: a skip when transformers itself cannot build the config, else a finding."""
    if str(error).startswith("Building"):
        row["skipped"] = f"build: {str(error)[:200]}"
    else:
        row["estimate_error"] = f"{where}{type(error).__name__}: {str(error)[:200]}"


def shallow_against_full(model_type: str, architecture: str, depth: int) -> list[dict]:
    """In the child: the estimate from the shallow trace over the one from the full trace, per variant."""
    from prefect_accelerate.memory import EstimateOptions, depth as stacks, estimate

    folder, skipped = _written(model_type, architecture, depth, "deep")
    if folder is None:
        return skipped
    rows = []
    for variant, (precision, checkpointing) in VARIANTS.items():
        row: dict = {"family": model_type, "variant": variant, "architecture": architecture, "depth": depth}
        figures = []
        for shallow_from in (stacks.SHALLOW_FROM, 10**9):
            stacks.SHALLOW_FROM = shallow_from
            try:
                result = estimate(str(folder), EstimateOptions(
                    dtypes=("float32",), strategy="ddp", num_processes=1, batch_size=BATCH, seq_len=SEQ, device_type="cpu",
                    mixed_precision=precision, gradient_checkpointing=checkpointing))
                acts = result.profile.activations
                if acts.method != "traced":
                    row["skipped"] = f"not traced: {acts.note[:160]}"
                    break
                figures.append((result.breakdown.device_total_bytes, acts.note))
            except Exception as error:  # noqa: BLE001 - a finding: report it
                _failed(row, error)
                break
        stacks.SHALLOW_FROM = 8
        if len(figures) == 2:
            row["plan"] = figures[0][1].split(";")[0] if figures[0][1].startswith("Traced") else "traced in full"
            row["ratio"] = round(figures[0][0] / figures[1][0], 4)
        rows.append(row)
    return rows


def cuda_against_cpu(model_type: str, architecture: str, depth: int) -> list[dict]:
    """In the child: the estimate for a CUDA target (capability 9.0: CUDA's autocast policy, PyTorch's SDPA kernel
    rules, the kernels' own saved tensors) next to the one for CPU, per variant, without training. Nothing here
    is measured on a GPU: a finding is an estimate that raises, or a path traced for CPU and not for CUDA."""
    from prefect_accelerate.memory import EstimateOptions, estimate
    from prefect_accelerate.memory.fit import unmodelled_paths

    folder, skipped = _written(model_type, architecture, depth, "cuda")
    if folder is None:
        return skipped
    rows = []
    for variant, (precision, checkpointing) in VARIANTS.items():
        row: dict = {"family": model_type, "variant": variant, "architecture": architecture, "blocks": depth}
        figures = {}
        for target in ("cpu", "cuda"):
            try:
                result = estimate(str(folder), EstimateOptions(
                    dtypes=("float32",), strategy="ddp", num_processes=1, batch_size=BATCH, seq_len=SEQ, device_type=target,
                    cuda_capability="9.0" if target == "cuda" else None, mixed_precision=precision,
                    gradient_checkpointing=checkpointing))
            except Exception as error:  # noqa: BLE001 - a finding: report it
                _failed(row, error, f"{target}: ")
                break
            acts = result.profile.activations
            row[f"{target}_activations"] = acts.method if acts is not None else "none"
            figures[target] = result.breakdown.device_total_bytes
            if target == "cuda":
                row["attention"] = result.breakdown.attention
                row["kernels"] = sorted(set(acts.attention_kernels)) if acts is not None else []
                row["unmodelled"] = unmodelled_paths(result)
        if len(figures) == 2 and row["cpu_activations"] == "traced":
            if row["cuda_activations"] != "traced":
                row["estimate_error"] = f"cuda: not traced where cpu was ({result.profile.activations.note[:160]})"
            else:
                row["ratio"] = round(figures["cuda"] / figures["cpu"], 3)
        rows.append(row)
    return rows


def run_family(model_type: str, architecture: str, depth: int = 2) -> list[dict]:
    """In the child: estimate and measure the three variants of one family."""
    from prefect_accelerate.memory import EstimateOptions, estimate
    from prefect_accelerate.memory.probe import cpu_training_peak

    rows = []
    folder, skipped = _written(model_type, architecture, depth, "family")
    if folder is None:
        return skipped
    for variant, (precision, checkpointing) in VARIANTS.items():
        row: dict = {"family": model_type, "variant": variant, "architecture": architecture, "blocks": depth}
        try:
            row["measured"] = cpu_training_peak(folder, BATCH, SEQ, precision, checkpointing, architecture)
        except Exception as error:  # noqa: BLE001 - transformers itself cannot train this config
            row["skipped"] = f"training: {type(error).__name__}: {str(error)[:160]}"
        gc.collect()  # nothing of this run may be freed while the next one records: a free counts against its peak
        try:
            result = estimate(str(folder), EstimateOptions(
                dtypes=("float32",), strategy="ddp", num_processes=1, batch_size=BATCH, seq_len=SEQ, device_type="cpu",
                mixed_precision=precision, gradient_checkpointing=checkpointing))
            row["estimate"] = result.breakdown.device_total_bytes
            row["activations"] = result.breakdown.activations_method
            row["attention"] = result.breakdown.attention
        except Exception as error:  # noqa: BLE001 - a finding: report it
            row["estimate_error"] = f"{type(error).__name__}: {str(error)[:200]}"
        if row.get("measured") and row.get("estimate") and row.get("activations") == "traced":
            row["ratio"] = round(row["estimate"] / row["measured"], 3)
        rows.append(row)
    return rows


def _cap_memory() -> None:
    def watch() -> None:
        while True:
            with open("/proc/self/statm") as statm:
                if int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") > RSS_CAP:
                    os._exit(3)
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()


def main() -> None:
    global BATCH, SEQ
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default="causal,masked,seq2seq")
    parser.add_argument("--only", action="append", default=[], help="a model_type (repeatable)")
    parser.add_argument("--out", help="append each run as a JSON line here (families already in it are skipped)")
    parser.add_argument("--sample", type=int, help="only this many families, drawn at random (with --seed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deep", type=int, help="N blocks a family; compare shallow traces with full ones (no training)")
    parser.add_argument("--blocks", type=int, default=2, help="blocks a family for the measured walk (8 or more: traced shallow)")
    parser.add_argument("--cuda", action="store_true",
                        help="estimates for a CUDA target (capability 9.0) next to CPU's, no training (--blocks deep)")
    parser.add_argument("--batch", type=int, default=BATCH, help=f"sequences a step (default {BATCH})")
    parser.add_argument("--seq", type=int, default=SEQ, help=f"tokens a sequence (default {SEQ}); long ones make the "
                                                              "attention's seq x seq tensors most of the peak")
    parser.add_argument("--width", type=int, default=TINY["hidden_size"], help="hidden size of every tiny config")
    parser.add_argument("--attention_heads", type=int, default=TINY["num_attention_heads"])
    parser.add_argument("--child", nargs=2, metavar=("MODEL_TYPE", "ARCHITECTURE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.batch, args.seq, args.width, args.attention_heads)
    default_shape = shape == (BATCH, SEQ, TINY["hidden_size"], TINY["num_attention_heads"])
    if args.child:
        _cap_memory()
        import sitecustomize  # noqa: F401 - the torchvision shim

        if (args.width, args.attention_heads) != (TINY["hidden_size"], TINY["num_attention_heads"]) or args.seq > SEQ:
            resize(args.width, args.attention_heads, args.seq)
        BATCH, SEQ = args.batch, args.seq
        os.environ.setdefault("PREFECT_ACCELERATE_PROFILE_CACHE", "off")
        print(json.dumps(shallow_against_full(*args.child, args.deep) if args.deep
                         else cuda_against_cpu(*args.child, args.blocks) if args.cuda else run_family(*args.child, args.blocks)))
        return
    seen: set[str] = set()
    if args.out and Path(args.out).exists():
        seen |= {json.loads(line)["family"] for line in Path(args.out).read_text().splitlines() if line.strip()}
    todo = [f for f in families(args.heads.split(",")) if not args.only or f[1] in args.only]
    if args.sample:
        import random

        random.Random(args.seed).shuffle(todo)
        todo = todo[:args.sample]
    rows: list[dict] = []
    for head, model_type, architecture in todo:
        if model_type in seen:
            continue
        seen.add(model_type)
        deep = ["--deep", str(args.deep)] if args.deep else ["--blocks", str(args.blocks), *(["--cuda"] if args.cuda else [])]
        sized = [f"--{flag}={value}" for flag, value in zip(("batch", "seq", "width", "attention_heads"), shape)]
        child = subprocess.run([sys.executable, __file__, "--child", model_type, architecture, *deep, *sized],
                               capture_output=True, text=True, timeout=1800)
        try:
            found = json.loads(child.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            why = "over the 5 GiB cap" if child.returncode == 3 else f"exit {child.returncode}: {child.stderr[-160:]}"
            found = [{"family": model_type, "variant": "-", "skipped": f"child: {why}"}]
        for row in found:
            row["head"] = head
            if not default_shape:
                row.update(zip(("batch", "seq", "width", "attention_heads"), shape))
            rows.append(row)
            if args.out:
                with open(args.out, "a") as out:
                    out.write(json.dumps(row) + "\n")
            ratio = f"{row['ratio']:.3f}" if "ratio" in row else "-"
            note = (row.get("estimate_error") or row.get("skipped") or row.get("plan")
                    or " ".join([",".join(row.get("kernels", [])), "; ".join(row.get("unmodelled", []))]).strip()
                    or ("" if "ratio" in row else row.get("activations", "")))
            print(f"{model_type:28s} {row['variant']:14s} {ratio:>6s}  {row.get('attention', '')[:24]:24s} {note[:90]}", flush=True)
    ratios = [row["ratio"] for row in rows if "ratio" in row]
    if ratios:
        inside = sum(0.90 <= r <= 1.10 for r in ratios)
        against = ("the full trace's estimate" if args.deep else "the CPU target's estimate (not a measurement)" if args.cuda
                   else "the measured peak")
        print(f"\n{len(ratios)} runs compared ({len(seen)} families): {inside} within 10% of {against}; "
              f"lowest {min(ratios):.3f}, highest {max(ratios):.3f}")
        if args.deep:
            print(f"  {sum(r == 1 for r in ratios)} equal to it")
        for row in rows:
            if "ratio" in row and not 0.90 <= row["ratio"] <= 1.10:
                print(f"  outside: {row['family']} {row['variant']} {row['ratio']:.3f}")
    errors = [row for row in rows if "estimate_error" in row]
    print(f"{len(errors)} estimates raised" + "".join(f"\n  {r['family']} {r['variant']}: {r['estimate_error']}" for r in errors))


if __name__ == "__main__":
    main()
