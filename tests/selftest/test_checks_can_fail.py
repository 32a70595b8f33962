"""Each self-test check must be able to fail: a collective that does nothing must turn its check red.

The self-test runs on two real CPU processes through `prefect-accelerate launch`; a small wrapper
replaces one torch.distributed call with a no-op, but only when the named check calls it, so every
other collective (and the outcome exchange between ranks) still works.
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

    check, call = sys.argv[1], sys.argv[2]
    real = getattr(dist, call)

    def does_nothing_inside_the_check(*args, **kwargs):
        if sys._getframe(1).f_code.co_name == "check_" + check:
            return None
        return real(*args, **kwargs)

    setattr(dist, call, does_nothing_inside_the_check)
    sys.exit(script.main())
""")


@pytest.mark.slow
@pytest.mark.parametrize(("check", "call", "expected"), [
    ("barrier", "barrier", "FAIL barrier on rank(s) 0: left the barrier before rank(s) [1] arrived"),
    ("rng_sync", "broadcast", "FAIL rng-sync on rank(s) 0,1: random draws differ after syncing"),
    ("all_reduce", "all_reduce", "FAIL all-reduce on rank(s) 0,1: sum"),
    ("broadcast", "broadcast", "FAIL broadcast on rank(s) 1: got"),
])
def test_a_collective_that_does_nothing_fails_its_check(tmp_path, check, call, expected):
    wrapper = tmp_path / "sabotaged_selftest.py"
    wrapper.write_text(WRAPPER)
    done = subprocess.run(
        [sys.executable, "-m", "prefect_accelerate.cli.main", "launch", "--no-track", "--cpu", "--num_processes", "2",
         "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(wrapper), check, call],
        capture_output=True, text=True, timeout=180, env={**os.environ, "HF_HOME": str(tmp_path / "hf")})
    assert done.returncode != 0, done.stdout[-3000:]
    assert f"[selftest] {expected}" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    assert "[selftest] FAILED 1 check(s) failed." in done.stdout
