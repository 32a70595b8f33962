"""Accelerate 1.16.0 as a test oracle: what its launcher would run, on a machine we describe.

Accelerate is imported only here (a test-only dependency). Its device probes, port check, fp8 check
and CPU count are patched to describe the same machine our StaticHost describes, then the real
`_validate_launch_command` and `prepare_*` functions run. Nothing is launched.
"""

from __future__ import annotations

import contextlib
import os
import types
from dataclasses import dataclass
from unittest import mock

from prefect_accelerate.launchers.host import StaticHost


@dataclass
class Reference:
    launcher: str  # simple | torchrun
    env: dict[str, str]  # added or changed relative to os.environ
    cmd: list[str] | None  # simple launcher command
    torchrun: dict | None  # torchrun namespace fields Accelerate fills


TORCHRUN_FIELDS = (
    "nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "rdzv_backend", "rdzv_endpoint",
    "rdzv_conf", "standalone", "max_restarts", "monitor_interval", "role", "module", "no_python", "log_dir", "tee",
    "training_script", "training_script_args",
)


@contextlib.contextmanager
def describing(host: StaticHost):
    import accelerate.commands.launch as launch_mod
    import accelerate.utils.launch as util_launch
    import psutil

    device = types.SimpleNamespace(device_count=lambda: host.count)
    backend = (host.kind, device) if host.kind else (None, None)
    mpirun = {name: path for name, path in host.programs.items() if name in ("mpirun", "mpiexec")}
    version = host.outputs.get(f"{next(iter(mpirun), 'mpirun')} --version", "")
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(launch_mod, "get_torch_accelerator_backend", lambda *a, **k: backend))
        stack.enter_context(mock.patch.object(util_launch, "get_torch_accelerator_backend", lambda *a, **k: backend))
        stack.enter_context(mock.patch.object(launch_mod, "is_bf16_available", lambda *a, **k: host.bf16))
        stack.enter_context(mock.patch.object(launch_mod, "check_cuda_p2p_ib_support", lambda: True))
        stack.enter_context(mock.patch.object(util_launch, "is_fp8_available", lambda: host.fp8))
        stack.enter_context(mock.patch.object(util_launch, "is_port_in_use", lambda port: int(port) in host.busy_ports))
        stack.enter_context(mock.patch.object(util_launch, "which", lambda name: mpirun.get(name)))
        stack.enter_context(mock.patch.object(util_launch.subprocess, "check_output", lambda argv, **k: version.encode()))
        real_count = psutil.cpu_count
        stack.enter_context(mock.patch.object(psutil, "cpu_count", lambda logical=True: host.cores if not logical else real_count()))
        yield


def accelerate_reference(argv: list[str], host: StaticHost) -> Reference:
    """Run Accelerate's own merge and env builders for `argv` on the described host."""
    import torch.distributed.run as distrib_run
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import _filter_args, prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    before = dict(os.environ)
    with describing(host):
        args = launch_command_parser().parse_args(argv)
        args, defaults, _ = _validate_launch_command(args)
        if (args.use_fsdp or args.use_megatron_lm or args.multi_gpu) and not args.cpu:
            env = prepare_multi_gpu_env(args)
            namespace = _filter_args(
                args, distrib_run.get_args_parser(),
                ["--training_script", args.training_script, "--training_script_args", args.training_script_args],
            )
            fields = normalize({name: getattr(namespace, name) for name in TORCHRUN_FIELDS})
            return Reference("torchrun", _added(env, before), None, fields)
        cmd, env = prepare_simple_launcher_cmd_env(args)
        return Reference("simple", _added(env, before), cmd, None)


def _added(env: dict[str, str], before: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if before.get(k) != v}


def torchrun_fields(argv: list[str]) -> dict:
    """The same fields, from our argv (`python -m torch.distributed.run ...`), parsed by torchrun itself."""
    import torch.distributed.run as distrib_run

    index = argv.index("torch.distributed.run") + 1
    namespace = distrib_run.get_args_parser().parse_args(argv[index:])
    return normalize({name: getattr(namespace, name) for name in TORCHRUN_FIELDS})


def normalize(fields: dict) -> dict:
    """Values as torchrun interprets them (Accelerate stores some as text or None, the parser as numbers)."""
    out = dict(fields)
    for name in ("module", "no_python", "standalone"):
        out[name] = bool(out[name])
    out["master_port"] = None if out["master_port"] is None else int(out["master_port"])
    out["node_rank"] = int(out["node_rank"])
    out["max_restarts"] = int(out["max_restarts"])
    out["monitor_interval"] = float(out["monitor_interval"])
    out["rdzv_endpoint"] = out["rdzv_endpoint"] or ""
    out["training_script_args"] = list(out["training_script_args"])
    return out
