"""Launch overhead: the same no-op 2-process script through six launchers, median of N, as ratios to torchrun.

"tracked, default settings" is what a user gets with no PREFECT_API_URL: the long-lived local server of
PREFECT_HOME, started by an earlier call (the first call's cost, server start-up included, is printed
separately).

Run: .venv/bin/python bench/launch_overhead.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from _common import VENV_BIN, bench_env, local_prefect_server, median, print_table, time_command

NOOP = """\
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


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
    ours = [str(VENV_BIN / "prefect-accelerate"), "launch", "--cpu", "--num_processes", "2", *quiet]
    commands = [
        ("python -m torch.distributed.run", [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)], env),
        ("accelerate launch (ACCELERATE_USE_CPU=1 --multi_gpu)", [str(VENV_BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", *quiet, str(script)], {**env, "ACCELERATE_USE_CPU": "1"}),
        ("prefect-accelerate launch --no-track", [*ours, "--no-track", str(script)], env),
        ("prefect-accelerate launch (tracked, PREFECT_ACCELERATE_SERVER=ephemeral)", [*ours, "--track", str(script)], {**env, "PREFECT_ACCELERATE_SERVER": "ephemeral"}),
    ]
    results = [(name, median(time_command(argv, command_env, args.repeat, cwd=str(work)))) for name, argv, command_env in commands]
    local_env = {**env, "PREFECT_HOME": str(work / "prefect-local")}
    try:
        first = time_command([*ours, str(script)], local_env, 1, cwd=str(work))[0]  # starts the local server
        local = median(time_command([*ours, str(script)], local_env, args.repeat, cwd=str(work)))
    finally:
        subprocess.run([str(VENV_BIN / "prefect-accelerate"), "server", "stop"], env=local_env, capture_output=True)
    results.append(("prefect-accelerate launch (tracked, default settings, no PREFECT_API_URL)", local))
    with local_prefect_server() as (url, _home):
        served = median(time_command([*ours, "--track", str(script)], {**env, "PREFECT_API_URL": url}, args.repeat, cwd=str(work)))
    results.append(("prefect-accelerate launch (tracked, running local server)", served))
    base = results[0][1]
    print_table(f"2-process no-op launch on CPU, median of {args.repeat}", [(n, s, s / base) for n, s in results], "torchrun")
    print(f"first tracked call with default settings (starts the local server in a fresh PREFECT_HOME): {first:.2f} s "
          f"({first / base:.2f}x); tracked with defaults minus bare torchrun: {local - base:+.2f} s")


if __name__ == "__main__":
    main()
