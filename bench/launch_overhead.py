"""Launch overhead: the same no-op 2-process script through six launchers, median of N, as ratios to torchrun.

The commands run interleaved (round 1: each command once, round 2: each once again, ...), so a change in the
machine's load during the run touches every row alike. "tracked, default settings" is what a user gets with
no PREFECT_API_URL: the long-lived local server of PREFECT_HOME, started by an earlier call. "first call" is
that same command in a fresh PREFECT_HOME, which has to start the server; after each such call the server it
started is stopped at once, so its start-up does not load the machine during the next command.

Run: .venv/bin/python bench/launch_overhead.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import VENV_BIN, bench_env, local_prefect_server, median, print_table, time_command

NOOP = """\
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


def _program(name: str, module: str) -> list[str]:
    """The console script `name` next to this Python, else `python -m module` (a venv that borrows its packages)."""
    found = VENV_BIN / name
    return [str(found)] if found.exists() else [sys.executable, "-m", module]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-launch-"))
    script = work / "noop.py"
    script.write_text(NOOP)
    python = str(VENV_BIN / "python")
    env = bench_env(HF_HOME=str(work / "hf"), PREFECT_HOME=str(work / "prefect"), PREFECT_ACCELERATE_STATE_DIR=str(work / "state"))
    quiet = ["--mixed_precision", "no", "--dynamo_backend", "no", "--num_machines", "1"]
    cli = _program("prefect-accelerate", "prefect_accelerate.cli.main")
    ours = [*cli, "launch", "--cpu", "--num_processes", "2", *quiet]
    accelerate = _program("accelerate", "accelerate.commands.accelerate_cli")
    local_env = {**env, "PREFECT_HOME": str(work / "prefect-local")}
    torchrun = ("python -m torch.distributed.run", [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)], env)
    commands = [
        torchrun,
        ("accelerate launch (ACCELERATE_USE_CPU=1 --multi_gpu)", [*accelerate, "launch", "--multi_gpu", "--num_processes", "2", *quiet, str(script)], {**env, "ACCELERATE_USE_CPU": "1"}),
        ("prefect-accelerate launch --no-track", [*ours, "--no-track", str(script)], env),
        ("prefect-accelerate launch (tracked, PREFECT_ACCELERATE_SERVER=ephemeral)", [*ours, "--track", str(script)], {**env, "PREFECT_ACCELERATE_SERVER": "ephemeral"}),
        ("prefect-accelerate launch (tracked, default settings, no PREFECT_API_URL)", [*ours, str(script)], local_env),
    ]
    times: dict[str, list[float]] = {name: [] for name, _, _ in commands}
    first_name = "prefect-accelerate launch (tracked, default settings, first call: starts the server)"
    served_name = "prefect-accelerate launch (tracked, running local server)"
    times[first_name], times[served_name] = [], []
    try:
        subprocess.run([*cli, "server", "start"], env=local_env, capture_output=True, check=True, timeout=600)
        with local_prefect_server() as (url, _home):
            served_env = {**env, "PREFECT_API_URL": url}
            for round_ in range(args.repeat):
                for name, argv, command_env in commands:
                    times[name] += time_command(argv, command_env, 1, cwd=str(work))
                times[served_name] += time_command([*ours, "--track", str(script)], served_env, 1, cwd=str(work))
                fresh_env = {**env, "PREFECT_HOME": str(work / f"prefect-first-{round_}")}
                try:
                    times[first_name] += time_command([*ours, str(script)], fresh_env, 1, cwd=str(work))
                finally:
                    subprocess.run([*cli, "server", "stop"], env=fresh_env, capture_output=True, timeout=600)
                    shutil.rmtree(fresh_env["PREFECT_HOME"], ignore_errors=True)
    finally:
        subprocess.run([*cli, "server", "stop"], env=local_env, capture_output=True, timeout=600)
    results = [(name, median(values)) for name, values in times.items()]
    base = results[0][1]
    print_table(f"2-process no-op launch on CPU, interleaved, median of {args.repeat}", [(n, s, s / base) for n, s in results], torchrun[0])
    default = dict(results)
    print(f"tracked with defaults minus bare torchrun: {default[commands[-1][0]] - base:+.2f} s; "
          f"first call (starts the server) minus bare torchrun: {default[first_name] - base:+.2f} s")
    for name, values in times.items():
        print(f"  {name}: " + " ".join(f"{v:.2f}" for v in values))


if __name__ == "__main__":
    main()
