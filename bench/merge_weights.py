"""Time merge-weights against Accelerate's merge_fsdp_weights on the same checkpoint (not a test; prints a table).

    .venv/bin/python bench/merge_weights.py                      # the test checkpoint (hidden 16)
    .venv/bin/python bench/merge_weights.py --hidden 1792 --layers 4   # ~205 MB of weights

The checkpoint is made by make_checkpoint.py through our launcher (two FSDP2 ranks on CPU). Each merge
runs in a fresh process, so the times exclude the torch import and peak memory (ru_maxrss) is per merge.
CPU seconds (best of the runs) are the steadier figure on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent / "tests" / "merge" / "scripts"  # make_checkpoint.py

_RUN = r"""
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed.checkpoint  # imported before the clock starts
which, checkpoint, output, fmt, shard = sys.argv[1:6]
started, cpu = time.perf_counter(), time.process_time()
if which == "ours":
    from prefect_accelerate.merge import merge_weights
    merge_weights(checkpoint, output, unsafe_serialization=fmt == "bin", max_shard_size=shard)
else:
    import logging; logging.disable(logging.CRITICAL)
    from accelerate.utils import merge_fsdp_weights
    merge_fsdp_weights(checkpoint, output, safe_serialization=fmt == "safetensors")
elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
print(json.dumps({"seconds": elapsed, "cpu": cpu, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_checkpoint(root: Path, hidden: int, layers: int) -> Path:
    cmd = [sys.executable, "-m", "prefect_accelerate.cli.main", "launch", "--no-track", "--cpu", "--num_processes", "2",
           "--mixed_precision", "no", "--num_machines", "1", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
           str(HERE / "make_checkpoint.py"), str(root), "--hidden", str(hidden), "--layers", str(layers), "--no-optimizer"]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    print(f"made the checkpoint in {time.perf_counter() - started:.1f} s (two ranks, launch included)")
    return root / "pytorch_model_fsdp_0"


def merge(which: str, checkpoint: Path, output: Path, fmt: str, shard: str) -> dict:
    shutil.rmtree(output, ignore_errors=True)
    done = subprocess.run([sys.executable, "-c", _RUN, which, str(checkpoint), str(output), fmt, shard],
                          check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--shard", default="50MB", help="max_shard_size for the sharded run")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-merge-"))
    try:
        checkpoint = make_checkpoint(root / "ckpt", args.hidden, args.layers)
        size = sum(p.stat().st_size for p in checkpoint.iterdir())
        print(f"checkpoint: {size / 1e6:.1f} MB in {len(list(checkpoint.iterdir()))} files")
        runs = [("ours", "safetensors", "50GB"), ("accelerate", "safetensors", "-"), ("ours", "bin", "50GB"),
                ("accelerate", "bin", "-"), ("ours", "safetensors", args.shard)]
        print(f"{'merge':<12}{'format':<13}{'shards':<8}{'best s':>8}{'median s':>10}{'CPU s':>8}{'peak RSS MB':>13}")
        for which, fmt, shard in runs:
            results = [merge(which, checkpoint, root / "out", fmt, shard) for _ in range(args.repeat)]
            times = sorted(r["seconds"] for r in results)
            rss = max(r["peak_rss_mb"] for r in results)
            cpu = min(r["cpu"] for r in results)
            print(f"{which:<12}{fmt:<13}{shard:<8}{times[0]:>8.3f}{times[len(times) // 2]:>10.3f}{cpu:>8.3f}{rss:>13.0f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
