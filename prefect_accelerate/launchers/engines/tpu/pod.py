"""The local process of a TPU pod launch: stage files, run the gcloud steps, stop the workers when stopped.

    python -m prefect_accelerate.launchers.engines.tpu.pod <run folder>/tpu-pod.json

The JSON file is the plan's (plan.py): the exact gcloud commands, in order, and the one that
stops the workers. The launch supervisor (process.py) runs this driver like any launch, so its output
streams into the run logger and a deadline, Ctrl-C or a Prefect cancellation reach it as SIGTERM/SIGINT.
Ending the local `gcloud ssh` does not end the processes on the workers, so on any such signal the driver
runs the stop command (bounded by STOP_TIMEOUT, below the supervisor's grace period) before it exits.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

#: seconds the stop command may take; the supervisor's SIGKILL comes after its 20 s grace period
STOP_TIMEOUT = 15.0


class _Stopped(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum, frame):  # noqa: ARG001
    raise _Stopped(signum)


def stage_files(stage: dict) -> None:
    """Write the folder that scp copies to every worker: the script, and the forwarded variables (mode 600)."""
    folder = Path(stage["dir"])
    folder.mkdir(parents=True, exist_ok=True)
    for source in stage.get("copy") or []:
        shutil.copy2(source, folder / Path(source).name)
    names = stage.get("forward_env") or []
    if names:
        missing = [name for name in names if name not in os.environ]
        if missing:
            raise SystemExit(
                f"error: --env {' '.join(missing)} asks to pass this machine's value to the pod, but "
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set here. Set it, or write --env NAME=VALUE."
            )
        env_file = folder / stage["env_file"]
        fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            for name in names:
                handle.write(f"export {name}={shlex.quote(os.environ[name])}\n")


def _run(argv: list[str]) -> int:
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    try:
        return process.wait()
    except BaseException:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
        raise


def stop_workers(argv: list[str]) -> int | None:
    """Run the stop command once, bounded in time; its failure must not hide why we are stopping."""
    print("[prefect-accelerate] stopping the launch on every worker of the pod", flush=True)
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, timeout=STOP_TIMEOUT, check=False).returncode
    except (OSError, subprocess.SubprocessError) as error:
        print(f"[prefect-accelerate] could not stop the workers: {error}", flush=True)
        return None


def run_spec(spec: dict) -> int:
    """Run the steps in order; the first failing step's exit code is the launch's."""
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGTERM, signal.SIGINT)}
    remote_started = False
    stage = spec.get("stage")
    try:
        if stage:
            stage_files(stage)
        for argv in spec["steps"]:
            remote_started = remote_started or "ssh" in argv[:6]
            code = _run(argv)
            if code != 0:
                return code
        return 0
    except _Stopped as stopped:
        for sig in previous:  # a second signal must not interrupt the stop command
            signal.signal(sig, signal.SIG_IGN)
        if remote_started:
            stop_workers(spec["stop"])
        return 128 + stopped.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if stage:
            shutil.rmtree(stage["dir"], ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m prefect_accelerate.launchers.engines.tpu.pod <tpu-pod.json>", file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    return run_spec(spec)


if __name__ == "__main__":
    sys.exit(main())
