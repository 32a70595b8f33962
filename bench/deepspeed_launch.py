"""DeepSpeed launch: the same 2-rank ZeRO-2 training script through three launchers, median of N, as ratios.

Run: .venv/bin/python bench/deepspeed_launch.py [--repeat 3]

Compared: DeepSpeed's own `deepspeed --num_gpus 2`, `accelerate launch --use_deepspeed` and
`prefect-accelerate launch --no-track --use_deepspeed`, each starting examples/ds_train.py (3 steps of a
tiny model on DeepSpeed's CPU accelerator) through tests/launchers/scripts/ds_nojit.py, so no run pays
for compiling DeepSpeed's shared-memory op. The commands run in turn within each round, so a busy
machine slows them alike. Prints numbers, never a verdict.
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
from pathlib import Path

from _common import REPO, VENV_BIN, bench_env, free_port, median, print_table, time_command

SCRIPT = [str(REPO / "tests" / "launchers" / "scripts" / "ds_nojit.py"), str(REPO / "examples" / "ds_train.py")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-deepspeed-"))
    env = bench_env(HF_HOME=str(work / "hf"), PREFECT_ACCELERATE_STATE_DIR=str(work / "state"))
    flags = ["--num_processes", "2", "--zero_stage", "2", "--mixed_precision", "no", "--dynamo_backend", "no", "--num_machines", "1"]
    commands = {
        "deepspeed --num_gpus 2": lambda port: [str(VENV_BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port), *SCRIPT],
        "accelerate launch --use_deepspeed": lambda port: [str(VENV_BIN / "accelerate"), "launch", "--use_deepspeed", *flags,
                                                           "--main_process_port", str(port), *SCRIPT],
        "prefect-accelerate launch --no-track --use_deepspeed": lambda port: [
            str(VENV_BIN / "prefect-accelerate"), "launch", "--no-track", "--use_deepspeed", *flags, "--main_process_port", str(port), *SCRIPT],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    ports: list[int] = []
    try:
        for _ in range(args.repeat):
            for name, command in commands.items():
                ports.append(free_port())
                times[name] += time_command(command(ports[-1]), env, 1, cwd=str(work))
    finally:
        for port in ports:  # in case the shared-memory op ran after all
            for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
                os.remove(path)
    rows = [(name, median(values)) for name, values in times.items()]
    base = rows[0][1]
    print_table(f"2-rank ZeRO-2 DeepSpeed job on CPU, median of {args.repeat}", [(n, s, s / base) for n, s in rows], "deepspeed")


if __name__ == "__main__":
    main()
