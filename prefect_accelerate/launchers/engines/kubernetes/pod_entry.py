"""What every pod of a Kubernetes launch runs first: wait for pod 0's DNS name, take the node rank, become the launch.

    python -m prefect_accelerate.launchers.engines.kubernetes.pod_entry --wait-for JOB-0.SERVICE --timeout 600 \\
        --index-env JOB_COMPLETION_INDEX --nodes 4 -- python -m torch.distributed.run ... --node_rank '$(JOB_COMPLETION_INDEX)' ...

Pods start in any order, and a headless Service publishes pod 0's name only once pod 0 exists; a torchrun
that looks the name up before then dies ("Name or service not known": PyTorch's store treats a failed
lookup as fatal). So every pod first resolves the name, retrying with a short back-off up to `--timeout`
seconds; past that it prints one line naming the name and exits with DNS_TIMEOUT_EXIT_CODE. Then it puts
its index (the Job's JOB_COMPLETION_INDEX) after `--node_rank` (Kubernetes has usually expanded the
reference already; then the two must agree) and replaces itself with the launch (exec: the launch gets
the pod's signals directly).

This module imports only the standard library: it runs before anything else in the container.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

#: exit code of a pod whose rendezvous name never resolved (EX_UNAVAILABLE): tells it apart from a training failure
DNS_TIMEOUT_EXIT_CODE = 69
USAGE_EXIT_CODE = 2
#: longest pause between two lookups; the first retries come faster
MAX_BACKOFF_SECONDS = 2.0
#: a line every this many seconds while waiting, so a slow start is visible in the pod's log
PROGRESS_SECONDS = 30.0
PREFIX = "[prefect-accelerate]"


class WaitTimeout(Exception):
    """The name did not resolve in time; the message is the one line a user sees."""


def wait_for_name(name: str, timeout: float, *, clock=time.monotonic, sleep=time.sleep, resolve=socket.getaddrinfo,
                  say=lambda line: print(line, file=sys.stderr, flush=True)) -> float:
    """Resolve `name` until it works or `timeout` seconds pass; the seconds it took, or WaitTimeout."""
    started = clock()
    deadline = started + timeout
    delay = 0.05
    last_said = started
    while True:
        try:
            resolve(name, None)
            return clock() - started
        except (socket.gaierror, UnicodeError, OSError) as error:
            last_error = error
        now = clock()
        if now >= deadline:
            why = getattr(last_error, "strerror", None) or str(last_error)
            raise WaitTimeout(
                f"{PREFIX} pod 0's DNS name {name} did not resolve within {timeout:g} s ({why}); check that the headless "
                f"Service {name.split('.', 1)[-1]} exists in this namespace and that pod 0 was scheduled and started.")
        if now - last_said >= PROGRESS_SECONDS:
            say(f"{PREFIX} still waiting for {name} to resolve ({now - started:.0f} s of {timeout:g} s)")
            last_said = now
        sleep(min(delay, max(deadline - now, 0.0)))
        delay = min(delay * 2, MAX_BACKOFF_SECONDS)


def with_node_rank(command: list[str], index: int, reference: str) -> list[str]:
    """The command with this pod's index after `--node_rank` (where Kubernetes left the reference unexpanded)."""
    out = list(command)
    for i in range(1, len(out)):
        if out[i - 1] != "--node_rank":
            continue
        if out[i] == reference:
            out[i] = str(index)
        elif out[i] != str(index):
            raise ValueError(f"the command says --node_rank {out[i]}, but this pod's index is {index}")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print(f"{PREFIX} pod_entry: no launch command after `--`.", file=sys.stderr)
        return USAGE_EXIT_CODE
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="pod_entry")
    parser.add_argument("--wait-for", required=True, help="pod 0's DNS name")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--index-env", default="JOB_COMPLETION_INDEX")
    parser.add_argument("--nodes", type=int, required=True)
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    raw = os.environ.get(args.index_env)
    if raw is None or not raw.isdigit() or not 0 <= int(raw) < args.nodes:
        print(f"{PREFIX} {args.index_env} is {raw!r}, not a node index from 0 to {args.nodes - 1}: this pod must be started by "
              "an Indexed Job (completionMode: Indexed).", file=sys.stderr, flush=True)
        return USAGE_EXIT_CODE
    index = int(raw)
    try:
        command = with_node_rank(command, index, f"$({args.index_env})")
    except ValueError as error:
        print(f"{PREFIX} {error}.", file=sys.stderr, flush=True)
        return USAGE_EXIT_CODE
    if not command:
        print(f"{PREFIX} pod_entry: no launch command after `--`.", file=sys.stderr)
        return USAGE_EXIT_CODE
    try:
        took = wait_for_name(args.wait_for, args.timeout)
    except WaitTimeout as error:
        print(str(error), file=sys.stderr, flush=True)
        return DNS_TIMEOUT_EXIT_CODE
    print(f"{PREFIX} node {index} of {args.nodes}: {args.wait_for} resolved after {took:.1f} s; starting the launch", flush=True)
    try:
        os.execvp(command[0], command)
    except OSError as error:
        print(f"{PREFIX} could not start {command[0]!r} ({error.strerror}): is it installed in the image?", file=sys.stderr, flush=True)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
