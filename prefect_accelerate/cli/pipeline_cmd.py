"""`prefect-accelerate pipeline` (preflight, then launch) and `prefect-accelerate plan` (the DAG, no side effects).

Both take `accelerate launch`'s flags plus the memory-gate and pipeline options. `plan` imports
neither Prefect nor torch and starts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys

from prefect_accelerate.cli.launch_cmd import add_launch_arguments
from prefect_accelerate.cli.parser import NONDEFAULT
from prefect_accelerate.cli.tracking import add_tracking_flags, should_track
from prefect_accelerate.launchers.flags import LAUNCH_DEFAULTS
from prefect_accelerate.memory.choices import LIBRARIES, OPTIMIZERS
from prefect_accelerate.pipeline.models import PREFLIGHT_STEPS

FORCE_CHOICES = ("all", *PREFLIGHT_STEPS)


def _add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("pipeline")
    group.add_argument("--model", default=None, help="Model to size for the memory gate (folder with config.json, Hub id in the HF cache, or timm name).")
    group.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="Optimizer for the memory estimate.")
    group.add_argument("--batch_size", type=int, default=1, help="Per-device batch size for activation memory.")
    group.add_argument("--seq_len", type=int, default=None, help="Sequence length for activation memory (transformers models).")
    group.add_argument("--gradient_checkpointing", action="store_true", help="The script uses gradient checkpointing.")
    group.add_argument("--device_memory", default=None, help="Memory of one device, e.g. 80GiB (default: detected).")
    group.add_argument("--measure_memory", action="store_true",
                       help="The memory gate also builds --model with random weights on this machine's GPU (else CPU) and runs "
                            "3 real training steps in a child process; it then passes or fails on the measured peak.")
    group.add_argument("--library_name", default=None, choices=LIBRARIES, help="Library of --model when it cannot be read from its config.")
    group.add_argument("--no_install_test", dest="run_install_test", action="store_false", help="Skip the distributed self-test step.")
    group.add_argument("--require_approval", action="store_true", help="Pause before the launch until approved in the Prefect UI.")
    group.add_argument(
        "--force", action="append", nargs="?", const="all", choices=FORCE_CHOICES, default=None, metavar="STEP",
        help="Re-run cached steps: all of them, or the named step (repeatable). Right before the script, write `--force all`.",
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    pipeline = subparsers.add_parser(
        "pipeline", help="Preflight checks (cached when unchanged), then the launch, as a Prefect flow.",
        description="Run the preflight DAG (config -> env || memory -> memory fit -> DeepSpeed check -> self-test), then launch. "
        "Unchanged steps come from the cache; a failed step stops before the launch.",
    )
    add_launch_arguments(pipeline)
    _add_pipeline_arguments(pipeline)
    add_tracking_flags(pipeline, tracked_by_default=True)
    pipeline.set_defaults(func=run_pipeline)

    plan = subparsers.add_parser(
        "plan", help="Show the pipeline's DAG, what would run or come from the cache and why, and the launch plan.",
        description="Print the preflight DAG (Mermaid, or DOT with --format dot), each step's status and reason, and the exact "
        "launch plan. Starts nothing and needs no Prefect server; with --track it also publishes the plan as a table "
        "artifact (pipeline-plan-...) in Prefect.",
    )
    add_launch_arguments(plan)
    _add_pipeline_arguments(plan)
    plan.add_argument("--format", dest="graph_format", choices=("mermaid", "dot"), default="mermaid", help="Graph notation (default mermaid).")
    add_tracking_flags(plan, tracked_by_default=False)
    plan.set_defaults(func=run_plan)


def request_from_args(args: argparse.Namespace):
    from prefect_accelerate.pipeline.models import MemorySettings, PipelineRequest

    given = getattr(args, NONDEFAULT, set())
    flags = {dest: getattr(args, dest) for dest in LAUNCH_DEFAULTS if dest in given and dest != "config_file"}
    for secret in ("aws_access_key_id", "aws_secret_access_key"):
        if secret in flags:
            from prefect_accelerate.errors import UsageError

            raise UsageError(
                f"--{secret} cannot be passed to a pipeline: it would be stored in the flow run's parameters. Use an AWS "
                "profile, the environment, or a Prefect AwsCredentials block instead."
            )
    for own in ("grace_period", "run_dir"):
        if own in given:
            flags[own] = getattr(args, own)
    return PipelineRequest(
        script=args.training_script, script_args=list(args.training_script_args or []), config_file=args.config_file,
        launch_flags=flags, model=args.model,
        memory=MemorySettings(optimizer=args.optimizer, batch_size=args.batch_size, seq_len=args.seq_len,
                              gradient_checkpointing=args.gradient_checkpointing, device_memory=args.device_memory,
                              library_name=args.library_name, measure=args.measure_memory),
        run_install_test=args.run_install_test, require_approval=args.require_approval, force=list(args.force or []),
        timeout=args.timeout,
    )


def run_plan(args: argparse.Namespace, *, publish: bool | None = None) -> int:
    from prefect_accelerate.pipeline.graph import build_graph, to_dot, to_mermaid, to_table

    request = request_from_args(args)
    graph = build_graph(request)
    if should_track(args) if publish is None else publish:
        from prefect_accelerate.flows.pipeline import publish_plan

        publish_plan(request=request)
    if args.json:
        print(json.dumps({"steps": [s.model_dump() for s in graph.steps], "launch_plan": graph.launch_plan, "error": graph.error}, indent=2))
        return 0 if graph.error is None else 2
    print(to_dot(graph) if getattr(args, "graph_format", "mermaid") == "dot" else to_mermaid(graph))
    print()
    print(to_table(graph))
    print()
    if graph.launch_plan is not None:
        print("Launch plan:")
        print(json.dumps(graph.launch_plan, indent=2))
    if graph.error:
        print(f"error: {graph.error}", file=sys.stderr)
        return 2
    return 0


def run_pipeline(args: argparse.Namespace) -> int:
    request = request_from_args(args)
    if args.dry_run:
        return run_plan(args, publish=False)
    if should_track(args):
        from prefect_accelerate.flows.pipeline import launch_training

        result = launch_training(request=request)
    else:
        from prefect_accelerate.cli.launch_cmd import _raw_echo
        from prefect_accelerate.pipeline.direct import run_pipeline_direct

        result = run_pipeline_direct(request, on_line=_raw_echo)
    for step in result.preflight.steps:
        print(f"{step.step:16} {step.status:8} {step.reason}")
    if not result.launched:
        print("The launch was not approved; nothing was started.")
        return 1
    return 0
