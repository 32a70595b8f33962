"""A stop signal whose exception is swallowed by code we do not own still ends the command as a stop.

Found by hand: Ctrl-C to `env` while its probe was inside `import torch` was caught there; `env` printed
its report and exited 0. The CLI now records SIGINT and SIGTERM in its handlers and checks after the
command returns. Real processes: the command below swallows the exception the way that import did.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from prefect_accelerate.cli import env_cmd, main

    def swallowing(args):
        try:
            os.kill(os.getpid(), int(sys.argv[1]))
            time.sleep(5)
        except BaseException:  # what the third-party code did with the interrupt
            pass
        print("the command went on", flush=True)
        return 0

    env_cmd.run = swallowing
    sys.exit(main.main(["env"]))
""")


@pytest.mark.parametrize(("sig", "code", "said"), [
    (signal.SIGINT, 130, "Interrupted"),
    (signal.SIGTERM, 143, "Stopped by signal 15"),
])
def test_a_swallowed_stop_signal_is_still_a_stop(sig, code, said):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(int(sig))], capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert "the command went on" in done.stdout  # the exception really was swallowed
    assert done.returncode == code, done.stdout + done.stderr
    assert said in done.stderr and "Traceback" not in done.stderr


PROBE = textwrap.dedent("""
    import os, signal, sys, time
    from prefect_accelerate.cli import main
    from prefect_accelerate.envreport import probe

    real = probe._torch_facts

    def interrupted_inside_torch():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except BaseException:  # what `import torch` did with a Ctrl-C that landed inside it
            pass
        return real()

    probe._torch_facts = interrupted_inside_torch
    sys.exit(main.main(["env", "--no-track", "--no_import_check"]))
""")


def test_env_interrupted_inside_import_torch_prints_no_report():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.returncode == 130, done.stdout + done.stderr
    assert done.stdout == "" and "Interrupted" in done.stderr and "Traceback" not in done.stderr
