"""How fast is `estimate-memory`? Our path next to Accelerate's own meta-device path, on the same configs.

Configs: a Llama-3-70B shape and Mixtral-8x7B (MoE), written locally (nothing from the Hub). Each
figure is the median of 5 runs:

- warm, in one process after a first run (imports paid): our table alone, our table plus the
  ZeRO-3 breakdown with the activation trace, and Accelerate's `gather_data` (with `verify_on_hub`
  answered locally, since Accelerate cannot size a local folder otherwise: reference spike §6.1);
- cold, a fresh Python process per run (imports included): `prefect-accelerate estimate-memory` and
  Accelerate's `estimate_command`, both printing their table.

- the estimate cache (memory/profile_cache.py): `prefect-accelerate estimate-memory` on the Llama-3-70B
  shape with the ZeRO-3 breakdown, a fresh process each time: first run with an empty cache, the same
  command again, and another layout (ZeRO-2, 16 processes, optimizer offload) over the cached profile.

We print times and ratios; nothing here passes or fails.

    python bench/estimate_speed.py               # about 2 minutes on 2 CPU cores
    python bench/estimate_speed.py --repeats 3 --no-cold
    python bench/estimate_speed.py --cache-only  # just the estimate-cache rows
    python bench/estimate_speed.py --cold-only   # the issue's goal: a 70B-shape estimate in a fresh process, no cache

--cold-only prints wall-clock and CPU (user+sys of the child, less sensitive to a shared machine's load)
medians, and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHIMS = REPO / "tests" / "shims"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(SHIMS))  # torchvision shim: accelerate's estimate module imports timm
import sitecustomize  # noqa: E402,F401

os.environ.setdefault("HF_HUB_OFFLINE", "1")

OURS_COLD = """
import sys
from prefect_accelerate.cli import main
main.COMMAND_MODULES = tuple(dict.fromkeys((*main.COMMAND_MODULES, "prefect_accelerate.cli.estimate_cmd")))
sys.exit(main.main(["estimate-memory", sys.argv[1], "--no-track"]))
"""
ACCELERATE_COLD = """
import sys, types
import accelerate.commands.estimate as est
est.verify_on_hub = lambda repo, token=None: types.SimpleNamespace(library_name="transformers", config={})
est.estimate_command(est.estimate_command_parser().parse_args([sys.argv[1], "--library_name", "transformers"]))
"""


def write_configs(root: Path) -> dict[str, Path]:
    import transformers

    configs = {
        "llama-3-70b": transformers.LlamaConfig(
            hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
            vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False, architectures=["LlamaForCausalLM"]),
        "mixtral-8x7b": transformers.MixtralConfig(architectures=["MixtralForCausalLM"]),
    }
    folders = {}
    for name, config in configs.items():
        config.save_pretrained(root / name)
        folders[name] = root / name
    return folders


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def accelerate_path(folder: Path):
    import types

    import accelerate.commands.estimate as est

    est.verify_on_hub = lambda repo, token=None: types.SimpleNamespace(library_name="transformers", config={})
    args = est.estimate_command_parser().parse_args([str(folder), "--library_name", "transformers"])
    return lambda: est.gather_data(args)


def cold(script: str, folder: Path, repeats: int) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SHIMS), str(REPO), os.environ.get("PYTHONPATH", "")])}

    def once():
        subprocess.run([sys.executable, "-c", script, str(folder)], check=True, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)

    return median_time(once, repeats)


def cache_rows(folder: Path, repeats: int) -> None:
    """estimate-memory in fresh processes: empty cache, the same command again, another layout."""
    layout = ["--strategy", "zero3", "--num_processes", "8", "--mixed_precision", "bf16", "--no-track"]
    other = ["--strategy", "zero2", "--num_processes", "16", "--mixed_precision", "bf16", "--offload", "optimizer", "--no-track"]
    command = [sys.executable, "-m", "prefect_accelerate.cli.main", "estimate-memory", str(folder)]
    base = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SHIMS), str(REPO), os.environ.get("PYTHONPATH", "")])}

    def timed(argv: list[str], env: dict[str, str]) -> float:
        started = time.perf_counter()
        subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)  # exit 1 = does not fit: fine
        return time.perf_counter() - started

    firsts, repeats_, others = [], [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as cache:
            env = {**base, "PREFECT_ACCELERATE_PROFILE_CACHE": cache}
            firsts.append(timed(command + layout, env))
            repeats_.append(timed(command + layout, env))
            others.append(timed(command + other, env))
    print(f"\nestimate-memory {folder.name} (ZeRO-3 breakdown), fresh process, median of {repeats}:")
    print(f"  empty estimate cache   {statistics.median(firsts):6.2f}s  (imports torch and transformers, builds and traces)")
    print(f"  same command again     {statistics.median(repeats_):6.2f}s  (cache hit: neither torch nor transformers imported)")
    print(f"  another layout         {statistics.median(others):6.2f}s  (zero2 x16 + optimizer offload over the cached profile)")


def cold_rows(folder: Path, repeats: int, shim: bool = True) -> None:
    """The 70B-shape ZeRO-3 estimate in a fresh process with the estimate cache off: wall and CPU medians."""
    import resource

    layout = ["--strategy", "zero3", "--num_processes", "8", "--mixed_precision", "bf16", "--no-track"]
    command = [sys.executable, "-m", "prefect_accelerate.cli.main", "estimate-memory", str(folder), *layout]
    path = [str(SHIMS), str(REPO)] if shim else [str(REPO)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")]),
           "PREFECT_ACCELERATE_PROFILE_CACHE": "off"}
    walls, cpus = [], []
    load_before = os.getloadavg()[0]
    for _ in range(repeats):
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        # cwd: `python -m` puts the working directory first on sys.path, so run from this checkout
        done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
        walls.append(time.perf_counter() - started)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - used.ru_utime + after.ru_stime - used.ru_stime)
        if done.returncode not in (0, 1):
            raise SystemExit(f"estimate-memory failed ({done.returncode}): {done.stderr[-2000:]}")
    print(f"estimate-memory {folder.name} ZeRO-3, fresh process, cache off, median of {repeats}: "
          f"wall {statistics.median(walls):.2f}s (min {min(walls):.2f}s), CPU user+sys {statistics.median(cpus):.2f}s "
          f"(min {min(cpus):.2f}s); load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    # the floor any estimate built on transformers' config classes pays in a fresh process: importing torch, and
    # reading the folder's config.json with AutoConfig (which imports transformers and the family's config module)
    floors = {"import torch": "import torch",
              "AutoConfig.from_pretrained": f"from transformers import AutoConfig; AutoConfig.from_pretrained({str(folder)!r})"}
    for name, code in floors.items():
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            times.append(time.perf_counter() - started)
        print(f"  floor, a fresh process that only runs `{name}`: wall {statistics.median(times):.2f}s "
              f"(ours / this: {statistics.median(walls) / statistics.median(times):.2f})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-cold", action="store_true", help="Skip the fresh-process runs.")
    parser.add_argument("--cache-only", action="store_true", help="Only the estimate-cache rows.")
    parser.add_argument("--cold-only", action="store_true", help="Only the cold row (fresh process, cache off).")
    parser.add_argument("--no-shim", action="store_true",
                        help="--cold-only without the tests' torchvision shim (the venv as a user has it).")
    args = parser.parse_args(argv)
    if args.cold_only:
        with tempfile.TemporaryDirectory() as tmp:
            cold_rows(write_configs(Path(tmp))["llama-3-70b"], args.repeats, shim=not args.no_shim)
        return 0
    if args.cache_only:
        with tempfile.TemporaryDirectory() as tmp:
            cache_rows(write_configs(Path(tmp))["llama-3-70b"], args.repeats)
        return 0

    from prefect_accelerate.memory import EstimateOptions, estimate

    table_only = EstimateOptions()
    breakdown = EstimateOptions(strategy="zero3", num_processes=8, mixed_precision="bf16", seq_len=2048)
    print(f"median of {args.repeats}; warm = in one process after a first run, cold = a fresh process per run")
    header = (f"{'config':<13} {'ours: table':>12} {'ours: +zero3 breakdown':>23} {'accelerate':>11} "
              f"{'table ratio':>12} {'cold ours':>10} {'cold accelerate':>16} {'cold ratio':>11}")
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for name, folder in write_configs(Path(tmp)).items():
            estimate(str(folder), breakdown)  # warm-up: imports, lazy modules
            theirs = accelerate_path(folder)
            theirs()
            ours_table = median_time(lambda: estimate(str(folder), table_only), args.repeats)
            ours_full = median_time(lambda: estimate(str(folder), breakdown), args.repeats)
            accelerate_table = median_time(theirs, args.repeats)
            line = (f"{name:<13} {ours_table:11.2f}s {ours_full:22.2f}s {accelerate_table:10.2f}s "
                    f"{ours_table / accelerate_table:11.2f}x")
            if not args.no_cold:
                ours_cold = cold(OURS_COLD, folder, args.repeats)
                accelerate_cold = cold(ACCELERATE_COLD, folder, args.repeats)
                line += f" {ours_cold:9.2f}s {accelerate_cold:15.2f}s {ours_cold / accelerate_cold:10.2f}x"
            print(line)
        cache_rows(write_configs(Path(tmp))["llama-3-70b"], args.repeats)
    print("\nratio = ours / accelerate (below 1: we are faster). Cold runs are mostly Python imports (torch, transformers).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
