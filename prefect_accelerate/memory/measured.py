"""Measured GPU memory cases, as data: what bench/memory_accuracy_cuda.py writes and the tests hold us to.

A case describes one training run completely (model config, precision, batch, sequence, attention,
checkpointing) and what the GPU measured: the allocated (and, when known, reserved) peak, or that it ran
out of memory. The same description builds the real model on a GPU (`build_model`) and the estimate on
any machine (`case_options`, `write_config`), so the two cannot drift apart.

Nothing here imports pydantic or prefect at import time: the GPU bench runs where only torch,
transformers, timm and accelerate are installed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GIB = 1 << 30


def load_cases(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(provenance, cases) from a measurements file."""
    data = json.loads(Path(path).read_text())
    return data["provenance"], data["cases"]


def write_config(case: dict[str, Any], folder: Path) -> Path:
    """The case's model as a folder holding config.json, as a user would point estimate-memory at it."""
    folder.mkdir(parents=True, exist_ok=True)
    if case["library"] == "timm":
        (folder / "config.json").write_text(json.dumps(case["config"]))
        return folder
    transformers_config(case).save_pretrained(folder)
    return folder


def transformers_config(case: dict[str, Any]) -> Any:
    import transformers

    settings = dict(case["config"])
    return transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)


def case_options(case: dict[str, Any]) -> Any:
    """The EstimateOptions that describe the case's run on one CUDA device (DDP, one process, AdamW)."""
    from prefect_accelerate.memory.models import EstimateOptions

    return EstimateOptions(
        dtypes=("float32",), strategy="ddp", num_processes=1, mixed_precision=case["mixed_precision"],
        batch_size=case["batch_size"], seq_len=case.get("seq_len"), attn_implementation=case.get("attn_implementation"),
        gradient_checkpointing=case.get("gradient_checkpointing", False),
    )


def build_model(case: dict[str, Any], device: str) -> Any:
    """The real model of a case on ``device``, fp32 weights, in train mode (for the GPU bench)."""
    import torch

    with torch.device(device):
        if case["library"] == "timm":
            import timm

            config = case["config"]
            model = timm.create_model(config["architecture"], pretrained=False, num_classes=config.get("num_classes", 1000))
        else:
            import transformers

            config = transformers_config(case)
            cls = getattr(transformers, config.architectures[0])
            kwargs = {"attn_implementation": case["attn_implementation"]} if case.get("attn_implementation") else {}
            model = cls._from_config(config, **kwargs)
    if case.get("gradient_checkpointing"):
        if case["library"] == "timm":
            model.set_grad_checkpointing(True)
        else:
            model.gradient_checkpointing_enable()
    return model.train()


def batch_for(case: dict[str, Any], model: Any, device: Any) -> dict[str, Any]:
    """Inputs and labels of the case's batch, as the training loop passes them: token ids (the labels too), or
    for a speech model mel features of the length its encoder takes with the transcript's tokens as labels."""
    import torch

    generator = torch.Generator().manual_seed(0)
    if case["library"] == "timm":
        size = tuple(model.pretrained_cfg.get("input_size") or (3, 224, 224))
        return {"x": torch.randn(case["batch_size"], *size, generator=generator).to(device),
                "y": torch.randint(0, model.num_classes, (case["batch_size"],), generator=generator).to(device)}
    ids = torch.randint(1, model.config.vocab_size, (case["batch_size"], case["seq_len"]), generator=generator).to(device)
    inputs = {"input_ids": ids, "labels": ids}
    frames = mel_frames(model)
    if frames:
        features = torch.randn(case["batch_size"], model.config.num_mel_bins, frames, generator=generator)
        inputs = {"input_features": features.to(device, next(model.parameters()).dtype), "labels": ids}
    if getattr(model.config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids
    return inputs


def mel_frames(model: Any) -> int | None:
    """Frames a speech encoder that takes channels-first mel features (``input_features`` of shape (batch,
    num_mel_bins, frames), Whisper's layout) is given in training: its positions times the stride of its
    convolutions, the one length its forward accepts (the feature extractor pads every clip to it).
    None when the model is not of that kind."""
    import torch

    config = model.config
    bins, positions = getattr(config, "num_mel_bins", None), getattr(config, "max_source_positions", None)
    if model.main_input_name != "input_features" or not bins or not positions:
        return None
    encoder = model.get_encoder() if hasattr(model, "get_encoder") else model
    convolutions = [m for m in encoder.modules() if isinstance(m, torch.nn.Conv1d)]
    if not convolutions or convolutions[0].in_channels != bins:
        return None
    stride = 1
    for conv in convolutions:
        stride *= conv.stride[0]
    return positions * stride


def train_step(case: dict[str, Any], model: Any, optimizer: Any, batch: dict[str, Any], device_type: str,
               kept: dict[str, Any] | None = None) -> Any:
    """One step of Accelerate's example loop; returns the outputs.

    The loop's `outputs = model(**batch)` keeps the step's outputs until the next forward replaces them,
    through backward and the optimizer step. Pass the same ``kept`` dict every step to do exactly that: the
    new outputs replace the old ones there as soon as the forward returns. A caller that instead holds the
    returned outputs in its own variable keeps two steps' outputs through the whole next step.
    """
    import torch

    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=case["mixed_precision"] == "bf16"):
        if case["library"] == "timm":
            logits = model(batch["x"])
            loss = torch.nn.functional.cross_entropy(logits.float(), batch["y"])
            out = {"logits": logits, "loss": loss}
        else:
            out = model(**batch)
            loss = out.loss
    if kept is not None:
        kept["outputs"] = out
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return out
