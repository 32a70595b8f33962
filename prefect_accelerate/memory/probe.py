"""`--measure`: build the model from its config with random weights on the target device and train a few steps.

The estimate models what torch and transformers do; the probe asks them. It runs in a child process
(``python -m prefect_accelerate.memory.probe``) so that whatever happens there (an out-of-memory error,
a crash in a kernel, a cached block the allocator keeps) ends with that process: the device is clean
for the launch by construction, and an out-of-memory error is an answer ("does not fit: measured").

What the child does (`_run_probe`): builds the trained class from its config under ``torch.device(dev)``,
so the weights are allocated and randomly initialised directly on the device (no download, no CPU copy);
applies the layout's precision (16-bit weights for DeepSpeed/FSDP-style precision modes, fp32 weights under
``torch.autocast`` for DDP mixed precision), gradient checkpointing and optimizer; then runs ``steps`` of
``out = model(**batch)``, ``out.loss.backward()``, ``opt.step()``, ``opt.zero_grad(set_to_none=True)``
with the batch and sequence of the options, keeping ``out`` until the next step as a training loop does.

What it measures:

- CUDA: ``torch.cuda.max_memory_allocated()`` and ``max_memory_reserved()`` over the whole probe, and the
  memory used outside PyTorch's allocator (``mem_get_info`` total - free - reserved: context, handles).
- CPU: two figures. The allocated peak, from PyTorch's own accounting of its CPU allocator (every
  allocation and free it reports to the profiler, ``profile_memory=True``, added up in time order): the
  counterpart of ``max_memory_allocated`` and what the estimate models. And the growth of the process's
  peak resident set size (``getrusage(RUSAGE_SELF).ru_maxrss``) from just before the model was built to
  the end: every page the allocator and glibc's arenas touched (freed blocks glibc keeps, thread arenas,
  library buffers), which is what the machine must hold and what the CPU verdict rests on. RSS growth runs
  about 1.3x the allocated peak on small models here, which is why the two are reported apart. The child's
  address space is capped (``RLIMIT_AS``) to the device memory given, or this machine's free memory when
  that is less, so a run that does not fit fails with an allocation error there instead of waking the
  kernel's OOM killer; running out of the machine's free memory (rather than the budget) is reported as
  "not measured", never as a verdict about the device.

What it cannot measure: one process runs the whole model, so for ZeRO and FSDP (several processes sharing
the states) it measures the unsharded peak of one device, an upper bound for the model states but without
the sharded layout's gathered layers and communication buffers; the verdict for those layouts stays with the
estimate and the measurement is reported beside it. DDP's gradient buckets (several processes) are added
from the estimate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from prefect_accelerate.memory.models import EstimateOptions, MemoryEstimate, MeasuredPeak

DEFAULT_STEPS = 3
DEFAULT_TIMEOUT = 900.0
#: Layouts whose per-device peak one process can measure directly.
MEASURABLE_STRATEGIES = ("ddp",)


def measure(estimate: MemoryEstimate, *, device: str = "auto", steps: int = DEFAULT_STEPS, device_memory: int | None = None,
            timeout: float = DEFAULT_TIMEOUT) -> MeasuredPeak:
    """Run the probe for an estimate's model and layout in a child process; never raises for out-of-memory.

    Args:
        estimate: what `estimate()` returned (its source says where the config is; its options the layout).
        device: ``cuda``, ``cpu`` or ``auto`` (CUDA when this machine has a GPU).
        steps: training steps to run (the peak usually settles by the second: optimizer states appear in the first).
        device_memory: on CPU, the bytes the child may use (its address-space cap); None: no cap.
        timeout: seconds before the child is stopped (reported as ``outcome="failed"``).
    """
    source, options = estimate.source, estimate.options
    spec = {
        "library": source.library, "location": source.location if source.kind != "hub" else source.name,
        "kind": source.kind, "options": options.model_dump(mode="json"), "device": device, "steps": steps,
        "device_memory": device_memory, "precision_mode": _precision_mode(options),
    }
    with tempfile.TemporaryDirectory(prefix="prefect-accelerate-probe-") as tmp:
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps(spec))
        env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
        from prefect_accelerate.launchers.reaper import parent_death_hook

        try:
            # the launcher's parent-death signal: a kill -9 of this process ends the probe too (Ctrl-C, SIGTERM and
            # the timeout kill it through subprocess.run)
            child = subprocess.run([sys.executable, "-m", "prefect_accelerate.memory.probe", str(spec_file)],
                                   capture_output=True, text=True, timeout=timeout, env=env, start_new_session=True,
                                   preexec_fn=parent_death_hook())
        except subprocess.TimeoutExpired:
            return MeasuredPeak(outcome="failed", device="?", what="nothing", error=f"the probe ran past {timeout:.0f} s and was stopped")
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (child.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
        died = f"killed by signal {-child.returncode}" if child.returncode < 0 else f"exit {child.returncode}"
        return MeasuredPeak(outcome="failed", device="?", what="nothing", error=f"the probe process ended ({died}): {tail}")
    return MeasuredPeak.model_validate(json.loads(lines[-1]))


def _precision_mode(options: EstimateOptions) -> str:
    from prefect_accelerate.memory.strategies import precision_mode

    return precision_mode(options) if options.strategy else ("fp32" if options.mixed_precision == "no" else f"autocast-{options.mixed_precision}")


# ------------------------------------------------------------------------------------------------ the child


def _prepare(spec: dict[str, Any], torch: Any) -> Any:
    """Everything before the weights exist (config, class, imports of the modeling code); returns a builder."""
    options = spec["options"]
    weights = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec["precision_mode"].split("+")[0], torch.float32)
    if spec["library"] == "timm":
        import timm

        name = spec["location"] if spec["kind"] == "timm" else f"local-dir:{spec['location']}"

        def build_timm(device: Any) -> Any:
            with torch.device(device):
                model = timm.create_model(name, pretrained=False)
            model = model.to(weights)
            if options.get("gradient_checkpointing"):
                model.set_grad_checkpointing(True)
            return model

        return build_timm
    import transformers

    from prefect_accelerate.memory.build import _dtype_kwargs, trained_class
    from prefect_accelerate.memory.models import ModelSource

    remote = options.get("trust_remote_code", False)
    config = transformers.AutoConfig.from_pretrained(spec["location"], trust_remote_code=remote)
    source = ModelSource(name=spec["location"], kind=spec["kind"], library="transformers", location=spec["location"], config_sha256="-")
    constructor, _, is_auto = trained_class(config, options.get("model_class"), source)
    kwargs: dict[str, Any] = _dtype_kwargs(str(weights).removeprefix("torch."))
    if options.get("attn_implementation"):
        kwargs["attn_implementation"] = options["attn_implementation"]

    def build_transformers(device: Any) -> Any:
        with torch.device(device):  # weights allocated and initialised on the device itself
            if is_auto:
                model = constructor.from_config(config, trust_remote_code=remote, **kwargs)
            else:
                model = constructor._from_config(config, **kwargs)
        if options.get("gradient_checkpointing"):
            model.gradient_checkpointing_enable()
        return model

    return build_transformers


def _batch(spec: dict[str, Any], model: Any, device: Any, torch: Any) -> tuple[dict[str, Any], Any]:
    options = spec["options"]
    batch = options["batch_size"]
    if spec["library"] == "timm":
        size = tuple(model.pretrained_cfg.get("input_size") or (3, 224, 224))
        x = torch.randn(batch, *size, device=device, dtype=next(model.parameters()).dtype)
        return {"x": x}, torch.randint(0, model.num_classes, (batch,), device=device)
    from prefect_accelerate.memory.activations import default_seq_len

    config = model.config
    if model.main_input_name == "pixel_values":
        from prefect_accelerate.memory.activations import _image_size

        pixels = torch.randn(batch, getattr(config, "num_channels", 3), *_image_size(config), device=device,
                             dtype=next(model.parameters()).dtype)
        return {"pixel_values": pixels, "labels": torch.zeros(batch, dtype=torch.long, device=device)}, None
    from prefect_accelerate.memory.measured import batch_for

    case = {"library": "transformers", "batch_size": batch, "seq_len": options.get("seq_len") or default_seq_len(config)}
    return batch_for(case, model, device), None


def _optimizer(name: str, params: Any, torch: Any) -> Any:
    if name in ("adamw", "adam"):
        return (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(params, lr=1e-5)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-5, momentum=0.9)
    if name == "adafactor" and hasattr(torch.optim, "Adafactor"):
        return torch.optim.Adafactor(params, lr=1e-5)
    if name == "adamw_8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, lr=1e-5)
    raise ValueError(f"optimizer {name} cannot be built by this torch")


def _run_probe(spec: dict[str, Any]) -> dict[str, Any]:
    import resource

    import torch

    wanted = spec["device"]
    cuda = torch.cuda.is_available() and wanted in ("auto", "cuda")
    if wanted == "cuda" and not cuda:
        return {"outcome": "failed", "device": "cuda", "what": "nothing", "error": "no CUDA device here"}
    device = torch.device("cuda" if cuda else "cpu")
    described = torch.cuda.get_device_name(0) if cuda else "CPU"
    result: dict[str, Any] = {"device": described, "torch": torch.__version__, "steps": spec["steps"]}
    try:
        build = _prepare(spec, torch)
    except Exception as error:  # a config or class the probe cannot build: reported, the estimate stands
        return {**result, "outcome": "failed", "what": "nothing", "error": f"{type(error).__name__}: {str(error)[:300]}"}
    if cuda:
        result["what"] = "torch.cuda.max_memory_allocated / max_memory_reserved over build and steps"
        torch.cuda.reset_peak_memory_stats()
    else:
        import psutil

        process = psutil.Process()
        # start the intra-op thread pool now: its thread stacks are address space too, and the cap below is for the model
        torch.ones(1 << 20).mul_(2).sum()
        # the allocation recorder starts before the cap too: the profiler starts threads of its own
        recorder = allocation_recorder()
        recorder.__enter__()
        # cap the address space: an allocation past the budget fails in this process instead of the machine swapping.
        # The budget is the device memory given, but never more than this machine has free: past that, running out
        # says nothing about the device.
        free = psutil.virtual_memory().available
        budget = min(int(spec["device_memory"]), free) if spec.get("device_memory") else free
        ram_bound = not spec.get("device_memory") or free < int(spec["device_memory"])
        cap = process.memory_info().vms + budget
        uncapped = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (cap, uncapped[1]))
        baseline = process.memory_info().rss
    autocast = spec["precision_mode"].startswith("autocast-") or spec["precision_mode"].endswith("+autocast")
    low = torch.bfloat16 if "bf16" in spec["precision_mode"] else torch.float16
    try:
        model = build(device).train()
        optimizer = _optimizer(spec["options"]["optimizer"], model.parameters(), torch)
        inputs, target = _batch(spec, model, device, torch)
        out = None
        for _ in range(spec["steps"]):  # `out` of the last step stays alive through this forward, as in a loop
            with torch.autocast(device.type, dtype=low, enabled=autocast):
                if spec["library"] == "timm":
                    logits = model(**inputs)
                    loss = torch.nn.functional.cross_entropy(logits.float(), target)
                    out = logits
                else:
                    out = model(**inputs)
                    loss = out.loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        result["outcome"] = "ok"
    except (torch.OutOfMemoryError, MemoryError) as error:
        result.update(outcome="out of memory", error=str(error).splitlines()[0][:300])
    except RuntimeError as error:
        # under the address-space cap an allocation outside torch's allocator (a C++ `new` in a kernel or the
        # autograd engine) fails with std::bad_alloc, which torch re-raises as a RuntimeError
        if any(sign in str(error).lower() for sign in ("can't allocate memory", "out of memory", "bad_alloc")):
            result.update(outcome="out of memory", error=str(error).splitlines()[0][:300])
        else:
            result.update(outcome="failed", error=f"{type(error).__name__}: {str(error).splitlines()[0][:300]}")
    except Exception as error:  # the model's own code failing is reported, not raised
        result.update(outcome="failed", error=f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}")
    finally:
        if not cuda:  # the cap was for the training; reading the recorder's events needs memory of its own
            resource.setrlimit(resource.RLIMIT_AS, uncapped)
            recorder.__exit__(None, None, None)
    if not cuda and result["outcome"] == "out of memory" and ram_bound:
        result.update(outcome="failed", error=(f"the probe needed more than this machine's free memory ({budget / 2**30:.2f} GiB), "
                                               "so it says nothing about the device; run --measure where the device is"))
    if cuda:
        result["allocated_peak_bytes"] = int(torch.cuda.max_memory_allocated())
        result["reserved_peak_bytes"] = int(torch.cuda.max_memory_reserved())
        free, total = torch.cuda.mem_get_info()
        result["outside_allocator_bytes"] = int(total - free - torch.cuda.memory_reserved())
        result["device_total_bytes"] = int(total)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        result["rss_peak_growth_bytes"] = max(int(peak - baseline), 0)
        result["allocated_peak_bytes"] = allocation_peak(recorder)
        result["what"] = ("PyTorch's CPU allocator: peak of allocated bytes over build and steps (its allocation and free "
                          "events, profile_memory); and the growth of the probe process's peak resident set size "
                          "(getrusage ru_maxrss) from before the model was built to the end of the steps")
    return result


def allocation_recorder() -> Any:
    """A profiler that records only what the CPU allocator reports: each allocation and free, with its size."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], profile_memory=True)


def allocation_peak(recorder: Any) -> int:
    """The largest number of bytes the CPU allocator held at once while ``recorder`` ran (frees are negative)."""
    import torch

    cpu = torch.autograd.DeviceType.CPU
    events = [e for e in recorder.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == cpu]
    events.sort(key=lambda event: event.start_ns())
    held = peak = 0
    for event in events:
        held += event.nbytes()
        peak = max(peak, held)
    return int(peak)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    sys.stdout.flush()
    print(json.dumps(_run_probe(spec)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def cpu_training_peak(folder: str | Path, batch: int, seq: int, precision: str, checkpointing: bool,
                      architecture: str | None = None) -> int:
    """Build the transformers model of a config folder with random weights, train 3 AdamW steps of Accelerate's
    example loop on CPU in this process, and return the CPU allocator's peak over them (`allocation_recorder`).
    ``precision``: "no" or "bf16" (autocast). ``architecture``: the class, default the config's first.

    Its own function, so that nothing of one run is alive (and freed, which counts against a peak) while the
    caller records the next."""
    import torch
    import transformers

    from prefect_accelerate.memory.measured import batch_for, train_step

    config = transformers.AutoConfig.from_pretrained(folder)
    cls = getattr(transformers, architecture or config.architectures[0])
    case = {"library": "transformers", "batch_size": batch, "seq_len": seq, "mixed_precision": precision}
    torch.manual_seed(0)
    recorder = allocation_recorder()
    with recorder:
        model = cls._from_config(config).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        inputs = batch_for(case, model, "cpu")
        kept: dict = {}  # the loop's `outputs`: the step before's stay alive through the next forward
        for _ in range(3):
            train_step(case, model, optimizer, inputs, "cpu", kept)
        del kept, model, optimizer
    return allocation_peak(recorder)
