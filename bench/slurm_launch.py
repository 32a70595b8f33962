"""Slurm: sbatch-to-first-output and total wall time of a 2-node CPU DDP job, our launcher vs a hand-written script.

Brings up the test suite's real 2-node Slurm (tests/helpers/slurm_cluster.py; root, apt), then runs, N times
each, alternating: `prefect-accelerate launch --no-track --slurm --num_machines 2 ...` and `sbatch` of a
hand-written script that runs the same torchrun per node (the recipe of spike-slurm.md §4). Times are from the
submission to the first training line in the job's output and to the job's end (polled every 0.1 s).
Prints medians and ratios (ours / hand-written). Usage: python bench/slurm_launch.py [N=5]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from helpers.slurm_cluster import start_cluster  # noqa: E402

SCRIPT = REPO / "tests" / "launchers" / "engines" / "slurm" / "workload.py"
HAND = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output={out}
srun bash -c '{py} -m torch.distributed.run --nnodes 2 --nproc_per_node 1 --node_rank $SLURM_NODEID \
--master_addr 127.0.0.1 --master_port $((20000 + SLURM_JOB_ID % 10000)) {script}'
"""


def _follow(out_dir: Path, start: float, done) -> tuple[float, float]:  # noqa: ANN001
    first = None
    while True:
        if first is None and any("world=2" in p.read_text(errors="replace") for p in out_dir.glob("*.out")):
            first = time.monotonic() - start
        if done():
            total = time.monotonic() - start
            return (first if first is not None else total), total
        time.sleep(0.1)


def ours(work: Path) -> tuple[float, float]:
    run = Path(tempfile.mkdtemp(dir=work))
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "prefect_accelerate.cli.main", "launch", "--no-track", "--slurm", "--num_machines", "2",
                             "--num_processes", "2", "--run_dir", str(run), str(SCRIPT)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first, total = _follow(run, start, lambda: proc.poll() is not None)
    assert proc.returncode == 0, f"our launch failed ({run})"
    return first, total


def hand(work: Path) -> tuple[float, float]:
    run = Path(tempfile.mkdtemp(dir=work))
    script = run / "job.sbatch"
    script.write_text(HAND.format(out=run / "slurm-%j.out", py=sys.executable, script=SCRIPT))
    start = time.monotonic()
    job = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True).stdout.strip()

    def done() -> bool:
        state = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
        return any(f"JobState={s}" in state for s in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))

    return _follow(run, start, done)


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    work = Path(tempfile.mkdtemp(prefix="bench-slurm-"))
    cluster = start_cluster(work / "cluster")
    os.environ.update(cluster.env)
    results: dict[str, list[tuple[float, float]]] = {"ours": [], "hand": []}
    try:
        for _ in range(trials):
            results["hand"].append(hand(work))
            results["ours"].append(ours(work))
    finally:
        cluster.stop()
    med = {k: (statistics.median(f for f, _ in v), statistics.median(t for _, t in v)) for k, v in results.items()}
    print(f"Slurm 2-node CPU DDP job, median of {trials} (seconds)")
    print(f"{'':28}{'to first output':>18}{'total':>10}")
    print(f"{'hand-written sbatch':28}{med['hand'][0]:>18.2f}{med['hand'][1]:>10.2f}")
    print(f"{'prefect-accelerate --slurm':28}{med['ours'][0]:>18.2f}{med['ours'][1]:>10.2f}")
    print(f"{'ratio (ours / hand)':28}{med['ours'][0] / med['hand'][0]:>18.2f}{med['ours'][1] / med['hand'][1]:>10.2f}")


if __name__ == "__main__":
    main()
