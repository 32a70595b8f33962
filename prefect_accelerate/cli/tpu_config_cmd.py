"""`prefect-accelerate tpu-config`: `accelerate tpu-config`'s flags, run directly or as a Prefect flow.

`--debug` prints the gcloud command (`Running gcloud ...`, as Accelerate) and runs nothing; it imports
neither Prefect nor gcloud.
"""

from __future__ import annotations

import argparse

from prefect_accelerate.cli.tracking import add_tracking_flags, should_track

DESCRIPTION = (
    "Run commands on every worker of a TPU VM pod (set-up before `launch --tpu_cluster`), through "
    "`gcloud compute tpus tpu-vm ssh --worker all`. The pod's name and zone come from the flags, a TpuPodBlock, "
    "or the config file."
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("tpu-config", help="Run set-up commands on every worker of a TPU pod.", description=DESCRIPTION)
    config = parser.add_argument_group("Config Arguments", "Arguments that can be configured through `prefect-accelerate config`.")
    config.add_argument("--config_file", default=None, help="Config file to read tpu_name, tpu_zone, commands and command_file from.")
    config.add_argument("--tpu_name", default=None, help="The TPU VM's name (default: the config file's).")
    config.add_argument("--tpu_zone", default=None, help="The TPU VM's zone (default: the config file's).")
    pod = parser.add_argument_group("TPU Arguments", "What runs on the pod.")
    pod.add_argument("--use_alpha", action="store_true", help="Use `gcloud alpha`.")
    pod.add_argument("--command_file", default=None, help="A file with one command per line to run on every worker.")
    pod.add_argument("--command", action="append", nargs="+", help="A command to run on every worker (repeatable; several words are one command).")
    pod.add_argument("--install_accelerate", action="store_true", help="pip install Accelerate on every worker first.")
    pod.add_argument("--accelerate_version", default="latest", help="`latest`, `dev` (GitHub main) or a version such as 1.16.0.")
    pod.add_argument("--debug", action="store_true", help="Print the gcloud command instead of running it.")
    ours = parser.add_argument_group("prefect-accelerate")
    ours.add_argument("--tpu_project", default=None, help="Google Cloud project of the pod (default: gcloud's configured one).")
    ours.add_argument("--tpu_block", default=None, help="Name of a saved TpuPodBlock holding the pod's name, zone and project.")
    ours.add_argument("--install_prefect_accelerate", action="store_true",
                      help="pip install prefect-accelerate on every worker (needed by `launch --tpu_cluster`).")
    ours.add_argument("--prefect_accelerate_version", default="latest", help="`latest`, a version, or a wheel path/URL reachable from the pod.")
    ours.add_argument("--timeout", type=float, default=None, help="Stop gcloud after this many seconds.")
    add_tracking_flags(parser, tracked_by_default=True)
    parser.set_defaults(func=run)


def request_from_args(args: argparse.Namespace):
    from prefect_accelerate.tpu_config import resolve_tpu_config

    return resolve_tpu_config(
        config_file=args.config_file, tpu_name=args.tpu_name, tpu_zone=args.tpu_zone, tpu_project=args.tpu_project,
        tpu_block=args.tpu_block, use_alpha=args.use_alpha, command=args.command, command_file=args.command_file,
        install_accelerate=args.install_accelerate, accelerate_version=args.accelerate_version,
        install_prefect_accelerate=args.install_prefect_accelerate, prefect_accelerate_version=args.prefect_accelerate_version,
    )


def run(args: argparse.Namespace) -> int:
    request = request_from_args(args)
    if args.debug:
        print(request.debug_line())
        return 0
    if should_track(args):
        from prefect_accelerate.flows.tpu import tpu_config_flow

        tpu_config_flow(request=request, timeout=args.timeout)
    else:
        from prefect_accelerate.tpu_config import run_tpu_config

        run_tpu_config(request, on_line=lambda label, line: print(line, flush=True), timeout=args.timeout)
    print("Successfully setup pod.")
    return 0
