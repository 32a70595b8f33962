"""How close is `estimate-memory` to real training? Estimate / measured for a few tiny models.

For each model we train a few real steps on CPU with AdamW (foreach, as on GPUs) and measure the peak of
live tensor memory with PyTorch's `torch.distributed._tools.mem_tracker.MemTracker` (it follows every
tensor storage through a dispatch mode and sorts it into parameters, gradients, optimizer states,
activations and temporaries). The estimate models CPU's own attention and dropout kernels
(`device_type="cpu"`), since that is what runs here. When a CUDA device is present, the same runs also
report `torch.cuda.max_memory_allocated` against the CUDA estimate; bench/memory_accuracy_cuda.py measures
real sizes on a GPU. We print ratios; nothing here passes or fails.

The loop is Accelerate's example loop: `outputs = model(**batch)`, `outputs.loss.backward()`, so the
logits live through backward (a loop that keeps only the loss frees them earlier and peaks lower).
Three rows per model: "model states" (batch 1, short input: parameters + gradients + optimizer states
dominate), "with activations" (a real batch), and the same batch under bf16 autocast (Accelerate's mixed
precision without DeepSpeed/FSDP). The estimate is `ddp` on one process.

    python bench/memory_accuracy.py            # one to two minutes on 2 CPU cores
    python bench/memory_accuracy.py --steps 5
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "shims"))  # torchvision shim (CPU torch beside a CUDA torchvision wheel)
import sitecustomize  # noqa: E402,F401

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tiny_configs() -> dict[str, object]:
    import transformers

    common = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    return {
        "gpt2-tiny": transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8000, n_positions=512,
                                             architectures=["GPT2LMHeadModel"], **common),
        "bert-tiny": transformers.BertConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024,
                                             vocab_size=8000, max_position_embeddings=512, architectures=["BertForMaskedLM"]),
        "t5-tiny": transformers.T5Config(num_layers=3, num_decoder_layers=3, d_model=256, d_ff=1024, num_heads=4, d_kv=64,
                                         vocab_size=8000, decoder_start_token_id=0, architectures=["T5ForConditionalGeneration"]),
        "llama-tiny": transformers.LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                                               num_key_value_heads=2, vocab_size=8000, max_position_embeddings=1024,
                                               architectures=["LlamaForCausalLM"], **common),
    }


def save_configs(root: Path) -> dict[str, Path]:
    folders = {}
    for name, config in tiny_configs().items():
        folder = root / name
        config.save_pretrained(folder)
        folders[name] = folder
    folder = root / "timm-resnet18"
    folder.mkdir()
    (folder / "config.json").write_text('{"architecture": "resnet18", "num_classes": 100, '
                                        '"pretrained_cfg": {"input_size": [3, 128, 128], "num_classes": 100}}')
    folders["timm-resnet18"] = folder
    return folders


def real_model(folder: Path, library: str):
    if library == "timm":
        import timm

        return timm.create_model(f"local-dir:{folder}", pretrained=False)
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    cls = getattr(transformers, config.architectures[0])
    return cls(config)


def batch_for(model, library: str, batch: int, seq: int):
    import torch

    if library == "timm":
        size = model.pretrained_cfg["input_size"]
        return {"x": torch.randn(batch, *size), "y": torch.randint(0, 100, (batch,))}
    ids = torch.randint(1, model.config.vocab_size, (batch, seq))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = ids.clone()
    return inputs


def train_and_measure(model, library: str, batch: int, seq: int, steps: int, autocast: bool = False) -> dict[str, int]:
    """Peak live tensor memory over `steps` AdamW steps on CPU (the first step, which creates the states, included)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    data = batch_for(model, library, batch, seq)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        for step in range(steps):
            _train_step(model, optimizer, data, library, "cpu", autocast)
            if step < steps - 1:
                tracker.reset_mod_stats()  # MemTracker tracks one iteration of module stats at a time
    peak = tracker.get_tracker_snapshot("peak")
    device = next(iter(peak))
    stats = {str(k).split(".")[-1].lower(): int(v) for k, v in peak[device].items()}
    stats["model_states"] = sum(p.numel() * p.element_size() for p in model.parameters()) * 2 + sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    return stats


def train_on_cuda(model, library: str, batch: int, seq: int, steps: int, autocast: bool = False) -> int:  # pragma: no cover - GPU
    """The same steps on the GPU; `torch.cuda.max_memory_allocated` over them (weights and data included)."""
    import torch

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = model.cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    data = {k: v.cuda() for k, v in batch_for(model, library, batch, seq).items()}
    for _ in range(steps):
        _train_step(model, optimizer, data, library, "cuda", autocast)
    torch.cuda.synchronize()
    peak = int(torch.cuda.max_memory_allocated())
    del model, optimizer, data
    torch.cuda.empty_cache()
    return peak


def _train_step(model, optimizer, data, library: str, device: str, autocast: bool) -> None:
    import torch

    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):  # Accelerate's mixed precision for DDP
        if library == "timm":
            outputs = model(data["x"])
            loss = torch.nn.functional.cross_entropy(outputs.float(), data["y"])
        else:
            outputs = model(**data)  # kept through backward, as in Accelerate's examples (`outputs.loss`)
            loss = outputs.loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)

    import torch

    from prefect_accelerate.memory import EstimateOptions, estimate
    from prefect_accelerate.memory.units import human_bytes

    torch.manual_seed(0)
    runs = [("model states", 1, 32, "no"), ("with activations", 8, 256, "no"), ("bf16 autocast", 8, 256, "bf16")]
    header = (f"{'model':<14} {'run':<17} {'estimate':>11} {'measured':>11} {'ratio':>6}   "
              f"{'states est.':>11} {'states meas.':>12} {'ratio':>6}   {'act. est.':>10} {'act.+temp at peak':>17}")
    print("Measured with torch.distributed._tools.mem_tracker.MemTracker (peak of live tensors, CPU), AdamW foreach.")
    print("estimate = per-device total for --strategy ddp --num_processes 1 (fp32, or bf16 autocast); states = params + grads + Adam states.")
    print(header)
    print("-" * len(header))
    ratios: list[float] = []
    gpu_ratios: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        folders = save_configs(Path(tmp))
        for name, folder in folders.items():
            library = "timm" if name.startswith("timm") else "transformers"
            for label, batch, seq, precision in runs:
                est = estimate(str(folder), EstimateOptions(strategy="ddp", batch_size=batch, seq_len=seq, mixed_precision=precision,
                                                                device_type="cpu"))
                b = est.breakdown
                measured = train_and_measure(real_model(folder, library), library, batch, seq, args.steps, precision == "bf16")
                est_states = sum(b.item(k).bytes for k in ("parameters", "gradients", "optimizer_states"))
                act = b.item("activations").bytes + b.item("backward_temporaries").bytes
                meas_act = measured.get("act", 0) + measured.get("temp", 0)
                ratio = b.device_total_bytes / measured["total"]
                ratios.append(ratio)
                print(f"{name:<14} {label:<17} {human_bytes(b.device_total_bytes):>11} {human_bytes(measured['total']):>11} "
                      f"{ratio:6.2f}   {human_bytes(est_states):>11} {human_bytes(measured['model_states']):>12} "
                      f"{est_states / measured['model_states']:6.2f}   {human_bytes(act):>10} {human_bytes(meas_act):>17}")
                if torch.cuda.is_available():  # pragma: no cover - GPU machines only
                    # the GPU runs CUDA's attention and dropout kernels: estimate for those
                    on_gpu = estimate(str(folder), EstimateOptions(strategy="ddp", batch_size=batch, seq_len=seq,
                                                                   mixed_precision=precision)).breakdown.device_total_bytes
                    gpu = train_on_cuda(real_model(folder, library), library, batch, seq, args.steps, precision == "bf16")
                    gpu_ratios.append(on_gpu / gpu)
                    print(f"{'':<14} {'  on ' + torch.cuda.get_device_name():<17} {human_bytes(on_gpu):>11} {human_bytes(gpu):>11} "
                          f"{on_gpu / gpu:6.2f}   (torch.cuda.max_memory_allocated; bench/memory_accuracy_cuda.py for real sizes)")
    print(f"\nestimate / measured: min {min(ratios):.2f}, max {max(ratios):.2f} (aim: within 0.85-1.15)")
    if gpu_ratios:  # pragma: no cover - GPU machines only
        print(f"on the GPU (max_memory_allocated): min {min(gpu_ratios):.2f}, max {max(gpu_ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
