"""A stand-in `torch_xla` for tests (the real one cannot run here: it needs exactly torch 2.9.0).

It records how it was called ($FAKE_XLA_LOG, one JSON line per call) and runs the function the way the
real launcher does on one host: `fn(index, *args)` in processes started with multiprocessing's spawn
method, one per device ($FAKE_XLA_DEVICES, default 1). $FAKE_XLA_API=spawn hides `torch_xla.launch`, so
callers must use `xla_multiprocessing.spawn` (older torch_xla). The device type is $FAKE_XLA_DEVICE_TYPE
(default CPU), reported by `torch_xla.runtime.device_type()`.
"""

import json
import multiprocessing
import os

__version__ = "0.0.0+stand-in"

WATCHED = ("XLA_USE_BF16", "XLA_DOWNCAST_BF16", "ACCELERATE_DEBUG_MODE", "PYTHONUNBUFFERED", "ACCELERATE_IN_TPU_POD")


def _record(kind, **data):
    log = os.environ.get("FAKE_XLA_LOG")
    if log:
        entry = {"call": kind, "pid": os.getpid(), "env": {k: os.environ.get(k) for k in WATCHED}, **data}
        with open(log, "a") as handle:
            handle.write(json.dumps(entry) + "\n")


def _run_all(fn, args, nprocs=None):
    count = int(os.environ.get("FAKE_XLA_DEVICES", "1"))
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=fn, args=(index, *args)) for index in range(count)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        raise SystemExit(failed[0] if failed[0] > 0 else 1)


def launch(fn, args=(), start_method="spawn", debug_single_process=False):
    _record("torch_xla.launch", args=list(args), start_method=start_method, function=type(fn).__name__)
    _run_all(fn, args)


if os.environ.get("FAKE_XLA_API") == "spawn":
    del launch
