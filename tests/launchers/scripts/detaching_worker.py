"""Test worker whose helpers leave its process tree, as data loaders, tokenizer servers and profilers do.

PIDDIR: each process writes its pid to <dir>/<kind>-<rank>.pid (kind: worker, setsid, daemon)
DETACH: comma list of helpers to start: `setsid` (`setsid -f python -c 'sleep'`: a new session, re-parented
  when setsid's own process exits) and `daemon` (the classic double fork: fork, setsid, fork, first child exits)
WORKER_SLEEP: seconds the worker lives after starting them (default 600)
PRINT_SECRET: name of a variable whose value the worker prints every 20 ms while it lives
"""

import os
import subprocess
import sys
import time

rank = os.environ.get("RANK", "0")
folder = os.environ["PIDDIR"]
sleeper = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)"
kinds = [kind for kind in os.environ.get("DETACH", "setsid,daemon").split(",") if kind]


def write_pid(kind: str, pid: int) -> None:
    tmp = os.path.join(folder, f".{kind}-{rank}.tmp")
    with open(tmp, "w") as handle:
        handle.write(str(pid))
    os.replace(tmp, os.path.join(folder, f"{kind}-{rank}.pid"))


if "setsid" in kinds:
    subprocess.run(["setsid", "-f", sys.executable, "-c", sleeper, os.path.join(folder, f"setsid-{rank}.pid")], check=True)
if "daemon" in kinds and os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        write_pid("daemon", os.getpid())
        time.sleep(600)
    os._exit(0)
write_pid("worker", os.getpid())
secret_name = os.environ.get("PRINT_SECRET")
end = time.monotonic() + float(os.environ.get("WORKER_SLEEP", "600"))
while time.monotonic() < end:
    if secret_name:
        print(f"rank {rank} says {os.environ.get(secret_name)}", flush=True)
        print(f"rank {rank} warns {os.environ.get(secret_name)}", file=sys.stderr, flush=True)
    time.sleep(0.02 if secret_name else 0.2)
