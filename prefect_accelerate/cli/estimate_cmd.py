"""`prefect-accelerate estimate-memory`: Accelerate's table, a per-device breakdown, and a fit verdict.

Accelerate's flags (`model_name`, `--library_name`, `--dtypes`, `--trust_remote_code`) behave as in
`accelerate estimate-memory` 1.16.0, offline-first; the layout flags add the per-device breakdown.
Nothing here imports torch or prefect at import time (`prefect-accelerate --help` stays fast).
"""

from __future__ import annotations

import argparse
import json

from prefect_accelerate.cli.parser import given
from prefect_accelerate.cli.tracking import add_tracking_flags, should_track
from prefect_accelerate.memory.choices import (
    ATTN_IMPLEMENTATIONS,
    DEFAULT_DTYPES,
    DEFAULT_RESERVE_FRACTION,
    DTYPES,
    LIBRARIES,
    MIXED_PRECISIONS,
    OFFLOADS,
    OPTIMIZERS,
    STRATEGIES,
)

#: Flags that ask for the per-device breakdown (the strategy then defaults to ddp).
_LAYOUT_DESTS = ("strategy", "num_processes", "num_machines", "offload", "optimizer", "mixed_precision",
                 "gradient_checkpointing", "batch_size", "seq_len", "model_class", "device_memory", "attn_implementation",
                 "measure", "cuda_capability", "deepspeed_config_file")

#: Exit status when the verdict says the run does not fit (errors exit 2, as everywhere in the CLI).
NOT_FIT_EXIT_CODE = 1


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "estimate-memory",
        help="Size a model without downloading weights; per-device memory for a training layout, and whether it fits.",
        description=(
            "Accelerate's `estimate-memory` table (same numbers), from a local folder, the Hugging Face cache, the Hub "
            "or a timm name, without weights. Any layout flag (--strategy, --num_processes, --mixed_precision, "
            "--batch_size, --device_memory...) adds the per-device breakdown for training the model class with its "
            "head; --device_memory adds a fit verdict (exit status 1 when it does not fit or is at risk)."
        ),
    )
    p.add_argument("model_name", help="A folder holding config.json, a Hub repo id (the local cache first), or a timm architecture name.")
    p.add_argument("--library_name", choices=LIBRARIES, default=None,
                   help="The model's library; read from the config (or the Hub's metadata) when not given.")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DEFAULT_DTYPES), metavar="DTYPE",
                   help=f"Rows of the table, in order: any of {', '.join(DTYPES)} (default: {' '.join(DEFAULT_DTYPES)}).")
    p.add_argument("--trust_remote_code", action="store_true", default=False,
                   help="Allow the model's own modeling code (config `auto_map`) to run. Read that code first.")
    layout = p.add_argument_group("Training layout (per-device breakdown)")
    layout.add_argument("--model_class", default=None,
                        help="Class to train, e.g. AutoModelForSequenceClassification (default: the config's `architectures`).")
    layout.add_argument("--strategy", choices=STRATEGIES, default=None, help="How training is distributed (default: ddp).")
    layout.add_argument("--num_processes", type=int, default=1, help="Processes (devices) on all machines together (default: 1).")
    layout.add_argument("--num_machines", type=int, default=1, help="Machines (default: 1).")
    layout.add_argument("--offload", choices=OFFLOADS, default="none", help="What ZeRO/FSDP keeps in CPU memory (default: none).")
    layout.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="Optimizer (default: adamw).")
    layout.add_argument("--mixed_precision", choices=MIXED_PRECISIONS, default="no", help="Mixed precision (default: no).")
    layout.add_argument("--gradient_checkpointing", action="store_true", default=False, help="Recompute block activations in backward.")
    layout.add_argument("--batch_size", type=int, default=1, help="Samples per device per step (default: 1).")
    layout.add_argument("--seq_len", type=int, default=None,
                        help="Tokens per sample (default: the model's maximum, capped at 2048).")
    layout.add_argument("--attn_implementation", choices=ATTN_IMPLEMENTATIONS, default=None,
                        help="Attention to model for transformers models (default: the config's setting, else transformers' "
                             "pick: sdpa where the model supports it, else eager).")
    fit = p.add_argument_group("Fit verdict")
    fit.add_argument("--device_memory", default=None,
                     help="Memory of one device, e.g. 80GiB or 80GB, or `auto` for the smallest CUDA device here.")
    fit.add_argument("--reserve", type=float, default=DEFAULT_RESERVE_FRACTION,
                     help=("Extra share of device memory to keep back, on top of the modelled CUDA context and allocator "
                           f"fragmentation (default: {DEFAULT_RESERVE_FRACTION})."))
    fit.add_argument("--measure", action="store_true", default=False,
                     help=("Also build the model from its config with random weights on this machine's GPU (else CPU) and "
                           "run 3 real training steps of the layout in a child process; the verdict then rests on the "
                           "measured peak (an out-of-memory run is 'does not fit: measured'). No weights are downloaded."))
    layout.add_argument("--cuda_capability", default=None, metavar="MAJOR.MINOR",
                        help="Compute capability of the target GPU for the attention kernel rules, e.g. 9.0 (H100/H200), "
                             "8.0 (A100), 8.9 (L4) (default: this machine's GPU, else 9.0).")
    layout.add_argument("--deepspeed_config_file", default=None, metavar="PATH",
                        help="The DeepSpeed JSON config the launch uses: its ZeRO stage (when --strategy is not given), "
                             "offload, reduce_bucket_size (\"auto\": hidden_size squared, as Accelerate fills it in) "
                             "and overlap_comm.")
    p.add_argument("--json", action="store_true", default=False, help="Print the estimate (and verdict) as JSON.")
    add_tracking_flags(p, tracked_by_default=False)
    p.set_defaults(func=run)


def options_from_args(args: argparse.Namespace):  # noqa: ANN201 - EstimateOptions, imported lazily
    """Build EstimateOptions from parsed flags; any layout flag turns the breakdown on."""
    from prefect_accelerate.errors import UsageError
    from prefect_accelerate.memory.models import EstimateOptions
    from prefect_accelerate.memory.strategies import DS_JSON_OPTIONS

    wants_layout = any(given(args, dest) for dest in _LAYOUT_DESTS)
    for name in ("num_processes", "num_machines", "batch_size", "seq_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name} must be at least 1, got {value}.")
    strategy, offload, zero = (args.strategy or "ddp") if wants_layout else None, args.offload, {}
    if getattr(args, "deepspeed_config_file", None):
        from prefect_accelerate.memory.strategies import ZERO_STAGE_STRATEGY, deepspeed_json_settings

        zero = deepspeed_json_settings(args.deepspeed_config_file)
        stage = zero.get("stage")
        named = ZERO_STAGE_STRATEGY.get(stage) if stage is not None else None
        if args.strategy is None:
            strategy = named or "zero2"  # Accelerate's DeepSpeed plugin default stage
        elif named is not None and args.strategy != named:
            raise UsageError(f"--strategy {args.strategy} disagrees with `zero_optimization.stage: {stage}` in "
                             f"{args.deepspeed_config_file}, which is what DeepSpeed will run. Drop --strategy, or "
                             "change the stage in the file.")
        if not given(args, "offload"):
            offload = zero.get("offload", offload)
    return EstimateOptions(
        library_name=args.library_name,
        dtypes=tuple(args.dtypes),
        trust_remote_code=args.trust_remote_code,
        model_class=args.model_class,
        strategy=strategy,
        num_processes=args.num_processes,
        num_machines=args.num_machines,
        offload=offload,
        optimizer=args.optimizer,
        mixed_precision=args.mixed_precision,
        gradient_checkpointing=args.gradient_checkpointing,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        attn_implementation=args.attn_implementation,
        cuda_capability=_capability(args.cuda_capability),
        **{name: zero[name] for name in DS_JSON_OPTIONS if name in zero},
    )


def _capability(value: str | None) -> str | None:
    import re

    from prefect_accelerate.errors import UsageError

    if value is None:
        return None
    if not re.fullmatch(r"\d+\.\d+", value):
        raise UsageError(f"--cuda_capability takes MAJOR.MINOR, such as 9.0 (H100/H200) or 8.0 (A100); got `{value}`.")
    return value


def _measured(args: argparse.Namespace, options):  # noqa: ANN202 - (MemoryEstimate, FitVerdict)
    """Estimate, probe with real steps in a child process, and judge on the measurement."""
    from prefect_accelerate.memory.core import estimate
    from prefect_accelerate.memory.fit import check_measured
    from prefect_accelerate.memory.probe import measure
    from prefect_accelerate.memory.units import parse_memory_size

    device_memory = None if args.device_memory in (None, "auto") else args.device_memory
    result = estimate(args.model_name, options, cache=True, lean_imports=True)
    import torch

    budget = parse_memory_size(device_memory) if device_memory else None
    if device_memory is None and not torch.cuda.is_available():
        import psutil

        device_memory = budget = psutil.virtual_memory().available
    measured = measure(result, device="auto", device_memory=budget if not torch.cuda.is_available() else None)
    return result, check_measured(result, measured, device_memory, args.reserve)


def run(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    device_memory = None if args.device_memory in (None, "auto") else args.device_memory
    check = args.device_memory is not None or args.measure
    if args.measure:
        result, verdict = _measured(args, options)
    elif should_track(args):
        from prefect_accelerate.flows.memory import estimate_memory_flow

        result, verdict = estimate_memory_flow(args.model_name, options, device_memory=device_memory, check=check,
                                               reserve_fraction=args.reserve)
    else:
        from prefect_accelerate.memory.core import estimate
        from prefect_accelerate.memory.fit import check_fit

        result = estimate(args.model_name, options, cache=True, lean_imports=True)
        verdict = check_fit(result, device_memory, args.reserve) if check else None
    if args.json:
        payload = {"estimate": result.model_dump(mode="json"), "verdict": verdict.model_dump(mode="json") if verdict else None}
        print(json.dumps(payload, indent=2))
    else:
        from prefect_accelerate.memory.report import render_text

        print(render_text(result, verdict))
    return NOT_FIT_EXIT_CODE if verdict is not None and not verdict.fits else 0
