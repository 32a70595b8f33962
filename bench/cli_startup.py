"""How long the CLI takes to answer, next to Accelerate's: `--help` and `env`, median of N runs.

Run: .venv/bin/python bench/cli_startup.py [--repeat 5]
Both CLIs run with the torchvision shim on PYTHONPATH (tests/shims): without it `accelerate` cannot
start at all on these machines (docs/testing.md).
"""

from __future__ import annotations

import argparse
import tempfile

from _common import VENV_BIN, bench_env, median, print_table, time_command


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    env = bench_env(HF_HOME=tempfile.mkdtemp(prefix="bench-hf-"), PREFECT_HOME=tempfile.mkdtemp(prefix="bench-ph-"))
    ours, theirs = str(VENV_BIN / "prefect-accelerate"), str(VENV_BIN / "accelerate")
    pairs = [
        ("--help", [ours, "--help"], [theirs, "--help"]),
        ("env", [ours, "env", "--no-track"], [theirs, "env"]),
        ("env (no import check)", [ours, "env", "--no-track", "--no_import_check"], [theirs, "env"]),
    ]
    rows = []
    for label, mine, reference in pairs:
        reference_s = median(time_command(reference, env, args.repeat))
        mine_s = median(time_command(mine, env, args.repeat))
        rows.append((f"accelerate {label}", reference_s, 1.0))
        rows.append((f"prefect-accelerate {label}", mine_s, mine_s / reference_s))
    dry = median(time_command([ours, "launch", "--dry-run", "--cpu", "--num_processes", "2", "train.py"], env, args.repeat))
    rows.append(("prefect-accelerate launch --dry-run", dry, None))
    print_table(f"CLI start-up, median of {args.repeat}", rows, "the accelerate command above")


if __name__ == "__main__":
    main()
