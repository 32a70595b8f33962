"""The whole pipeline for the tiny example, as Prefect flows and as the same steps called directly.

Cold = every preflight step runs (`--force all`); resumed = every preflight step comes from the cache.
Median of N, as ratios to the direct run. The tracked runs use a running local `prefect server`
(the embedded server's start-up is measured separately in bench/launch_overhead.py).

Run: .venv/bin/python bench/pipeline_overhead.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _common import REPO, VENV_BIN, bench_env, local_prefect_server, median, print_table, time_command


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    env = bench_env(HF_HOME=str(work / "hf"), PREFECT_ACCELERATE_STATE_DIR=str(work / "state"))
    pipeline = [str(VENV_BIN / "prefect-accelerate"), "pipeline", "--cpu", "--num_processes", "2", "--mixed_precision", "no",
                "--dynamo_backend", "no", "--num_machines", "1"]
    example = str(REPO / "examples" / "ddp_allreduce.py")
    direct = median(time_command([*pipeline, "--no-track", example], env, args.repeat, cwd=str(work)))
    with local_prefect_server() as (url, home):
        served = {**env, "PREFECT_API_URL": url, "PREFECT_HOME": home}
        cold = median(time_command([*pipeline, "--track", "--force", "all", example], served, args.repeat, cwd=str(work)))
        resumed = median(time_command([*pipeline, "--track", example], served, args.repeat, cwd=str(work)))
    rows = [("steps called directly (--no-track)", direct, 1.0), ("pipeline flow, cold (--force all)", cold, cold / direct),
            ("pipeline flow, resumed (preflight cached)", resumed, resumed / direct)]
    print_table(f"pipeline for examples/ddp_allreduce.py on 2 CPU processes, median of {args.repeat}", rows, "direct")


if __name__ == "__main__":
    main()
