"""Accelerate 1.16.0's DeepSpeed launcher as a test oracle (the DeepSpeed half of helpers/oracle.py).

`launch_command` computes the DeepSpeed fields and calls `deepspeed_launcher`, which calls
`prepare_deepspeed_cmd_env` and then either runs the `deepspeed` command (appending to
./.deepspeed_env first) or runs torchrun in-process. Here the same steps run up to the command and
environment, on the machine `StaticHost` describes, and nothing is launched or written.
"""

from __future__ import annotations

import os
from unittest import mock

from helpers.oracle import Reference, TORCHRUN_FIELDS, _added, describing, normalize

from prefect_accelerate.launchers.host import StaticHost


def accelerate_deepspeed_reference(argv: list[str], host: StaticHost) -> Reference:
    """Accelerate's (launcher, env, cmd, torchrun fields) for a DeepSpeed launch of `argv` on `host`.

    `launcher` is "deepspeed" when Accelerate would run the `deepspeed` command (then `cmd` is it),
    else "torchrun" with the torchrun fields it would use. Run it in the launch's working directory:
    Accelerate puts `abspath(".")` on PYTHONPATH.
    """
    import accelerate.utils.launch as util_launch
    import torch.distributed.run as distrib_run
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import _filter_args, prepare_deepspeed_cmd_env

    before = dict(os.environ)
    with describing(host), mock.patch.object(util_launch, "compare_versions", lambda *a, **k: False):
        args = launch_command_parser().parse_args(argv)
        args, defaults, mp_from_config = _validate_launch_command(args)
        if not args.use_deepspeed or args.cpu:
            raise AssertionError(f"{argv} is not a DeepSpeed launch in Accelerate")
        fields = list(defaults.deepspeed_config.keys()) if defaults else []
        if mp_from_config:
            fields.append("mixed_precision")
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        cmd, env = prepare_deepspeed_cmd_env(args)
        if cmd is not None:
            return Reference("deepspeed", _added(env, before), list(cmd), None)
        namespace = _filter_args(
            args, distrib_run.get_args_parser(),
            ["--training_script", args.training_script, "--training_script_args", args.training_script_args],
        )
        return Reference("torchrun", _added(env, before), None, normalize({name: getattr(namespace, name) for name in TORCHRUN_FIELDS}))
