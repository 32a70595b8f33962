"""The single-host TPU launch, as the process a TPU plan starts (reference §4.3.4).

    python -m prefect_accelerate.launchers.engines.tpu.runner [--module] [--main_training_function main]
        [--bf16 use|downcast] -- script.py [script args...]

It imports the training script (or the module, with --module), finds its main function and runs it
through torch_xla's launcher: `torch_xla.launch` where it exists, else `xla_multiprocessing.spawn`, as
Accelerate's `tpu_launcher` does. Accelerate does this inside its own CLI process; a separate process
lets the launch supervisor stream, time-limit and stop it like any other launch.

bf16: with `--bf16`, and only when torch_xla reports a TPU, XLA_USE_BF16=1 (or XLA_DOWNCAST_BF16=1 for
`downcast`) is set before spawning, exactly Accelerate's rule; elsewhere (CPU or GPU PJRT) it changes nothing.

Exit codes: 2 when torch_xla is missing or the script has no such function, else the launcher's outcome.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

#: exit status for "this launch cannot start" (missing torch_xla, no main function), as usage errors
CANNOT_START = 2


class MainFunction:
    """Picklable stand-in for the script's main function: spawned children import the module by name.

    Called as `fn(index, *args)` by torch_xla; like Accelerate's PrepareForLaunch (type NO) it sets
    FORK_LAUNCHED=1 and calls the function without the index.
    """

    def __init__(self, module: str, function: str, search_path: str | None = None) -> None:
        self.module = module
        self.function = function
        self.search_path = search_path

    def resolve(self):
        if self.search_path and self.search_path not in sys.path:
            sys.path.insert(0, self.search_path)
        return getattr(importlib.import_module(self.module), self.function)

    def __call__(self, index: int, *args):  # noqa: ARG002 - the index is torch_xla's, not the script's
        os.environ["FORK_LAUNCHED"] = "1"
        return self.resolve()(*args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m prefect_accelerate.launchers.engines.tpu.runner", allow_abbrev=False)
    parser.add_argument("--module", action="store_true", help="The script is a module name (launch -m).")
    parser.add_argument("--main_training_function", default="main")
    parser.add_argument("--bf16", choices=("use", "downcast"), default=None)
    parser.add_argument("training_script")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return CANNOT_START


def on_tpu(torch_xla) -> bool:  # noqa: ANN001
    """Accelerate's `is_torch_xla_available(check_is_tpu=True)`: the runtime's device type is TPU."""
    try:
        import torch_xla.runtime as xr

        return xr.device_type() == "TPU"
    except Exception:  # no runtime, no device: not a TPU
        return False


def bf16_env(mode: str | None, tpu: bool) -> dict[str, str]:
    if mode is None or not tpu:
        return {}
    return {"XLA_DOWNCAST_BF16": "1"} if mode == "downcast" else {"XLA_USE_BF16": "1"}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    script_args = list(args.training_script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    try:
        import torch_xla
    except ImportError as error:
        from prefect_accelerate.errors import DependencyError

        return _fail(f"{DependencyError.missing('torch_xla', 'tpu', 'Launching on a TPU (--tpu)').message} ({error})")

    if args.module:
        module_name, search_path = args.training_script, None
    else:
        script = Path(args.training_script).resolve()
        if not script.is_file():
            return _fail(f"The training script {args.training_script} does not exist (working directory {os.getcwd()}).")
        # the script's own folder first, as `python script.py` would have it (Accelerate appends it)
        module_name, search_path = script.stem, str(script.parent)
    target = MainFunction(module_name, args.main_training_function, search_path)
    try:
        function = target.resolve()
    except AttributeError:
        module = sys.modules.get(module_name)
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")) if module else []
        return _fail(
            f"{args.training_script} has no function named {args.main_training_function!r}. Pass the one that starts "
            f"training with --main_training_function{' (it has: ' + ', '.join(names) + ')' if names else ''}."
        )
    module = sys.modules[module_name]
    del function
    sys.argv = [getattr(module, "__file__", None) or args.training_script, *script_args]
    os.environ.update(bf16_env(args.bf16, on_tpu(torch_xla)))

    launch = getattr(torch_xla, "launch", None)
    if launch is not None:
        launch(target, args=())
    else:
        import torch_xla.distributed.xla_multiprocessing as xmp

        xmp.spawn(target, args=())
    return 0


if __name__ == "__main__":
    # run the imported module's main, so MainFunction pickles as engines.tpu.runner.MainFunction, not __main__'s
    from prefect_accelerate.launchers.engines.tpu.runner import main as _main

    sys.exit(_main())
