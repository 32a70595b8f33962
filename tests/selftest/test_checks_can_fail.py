"""Each self-test check must be able to fail: a collective that does nothing must turn its check red.

The self-test runs on two real CPU processes through `prefect-accelerate launch`; a small wrapper
replaces torch.distributed calls with no-ops, but each only when one named check calls it, so every
other collective (and the outcome exchange between ranks) still works; it can also train without
DistributedDataParallel, or give every rank rank 0's share of the data. Several checks are sabotaged in
one launch: each must fail on its own while the untouched checks still pass.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

WRAPPER = textwrap.dedent("""
    import sys
    import torch.distributed as dist
    from prefect_accelerate.selftest import script

    import torch.nn.parallel
    import torch.utils.data

    class EveryRankIsRankZero(torch.utils.data.DistributedSampler):
        def __init__(self, dataset, **kwargs):
            super().__init__(dataset, **{**kwargs, "rank": 0})

    sabotage = {}  # torch.distributed call -> the checks in which it does nothing
    for pair in sys.argv[1:]:
        check, call = pair.split(":")
        if call == "ddp":  # the model is trained without DistributedDataParallel: no gradient averaging
            torch.nn.parallel.DistributedDataParallel = lambda module, *args, **kwargs: module
        elif call == "sampler":  # every rank draws rank 0's share
            torch.utils.data.DistributedSampler = EveryRankIsRankZero
        else:
            sabotage.setdefault(call, set()).add("check_" + check)

    def does_nothing_inside(call):
        real = getattr(dist, call)

        def replacement(*args, **kwargs):
            if sys._getframe(1).f_code.co_name in sabotage[call]:
                return None
            return real(*args, **kwargs)

        return replacement

    for call in sabotage:
        setattr(dist, call, does_nothing_inside(call))
    sys.exit(script.main())
""")

SABOTAGED = {
    "barrier:barrier": "FAIL barrier on rank(s) 0: left the barrier before rank(s) [1] arrived",
    "rng_sync:broadcast": "FAIL rng-sync on rank(s) 0,1: random draws differ after syncing",
    "all_reduce:all_reduce": "FAIL all-reduce on rank(s) 0,1: sum",
    "broadcast:broadcast": "FAIL broadcast on rank(s) 1: got",
    "training:ddp": "FAIL training-steps on rank(s) 0,1: weights differ across ranks",
    "sampler:sampler": "FAIL distributed-sampler on rank(s) 0,1: some samples were never assigned",
}
UNTOUCHED = ("process-group", "all-gather", "mixed-precision", "accelerator")


@pytest.mark.slow
def test_a_collective_that_does_nothing_fails_its_check_and_only_its_check(tmp_path):
    wrapper = tmp_path / "sabotaged_selftest.py"
    wrapper.write_text(WRAPPER)
    done = subprocess.run(
        [sys.executable, "-m", "prefect_accelerate.cli.main", "launch", "--no-track", "--cpu", "--num_processes", "2",
         "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(wrapper), *SABOTAGED],
        capture_output=True, text=True, timeout=180, env={**os.environ, "HF_HOME": str(tmp_path / "hf")})
    report = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 3, report
    for expected in SABOTAGED.values():
        assert f"[selftest] {expected}" in done.stdout, report
    for check in UNTOUCHED:
        assert f"[selftest] PASS {check}:" in done.stdout, report
    assert f"[selftest] FAILED {len(SABOTAGED)} check(s) failed." in done.stdout
