"""Fake cluster programs for DeepSpeed's runner: pdsh, ssh, mpirun, srun and their probes.

DeepSpeed's real runner checks for a launcher's program on PATH, asks `ssh HOST hostname` whether the
first host answers, then runs pdsh/mpirun/srun. These stand-ins let the real runner do all of that here:

- `pdsh -S -f N -w h1,h2 CMD...` runs CMD once per host *on this machine*, in parallel, with `%n`
  replaced by the host's index and a bare environment (PATH and HOME only), as a login on another
  machine would have: whatever the job needs must come through DeepSpeed's exports. Output lines are
  prefixed `host: ` as pdsh does. A `pkill` command (DeepSpeed's clean-up on SIGTERM) is recorded and
  not run, so it can never touch processes on this machine.
- `ssh [opts] HOST CMD...` runs CMD here.
- `mpirun`, `srun` record their argv and exit 0; `ompi_info`, `sinfo` and `mpiname` answer the
  runner's "is it installed" probes.

Every call is appended as a JSON line {"program", "argv"} to $FAKEBIN_LOG.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

_COMMON = '''
import json, os, signal, subprocess, sys
def record(name):
    log = os.environ.get("FAKEBIN_LOG")
    if log:
        with open(log, "a") as handle:
            handle.write(json.dumps({"program": name, "argv": sys.argv[1:]}) + "\\n")
'''

_PDSH = _COMMON + '''
record("pdsh")
if os.environ.get("FAKEBIN_RECORD_ONLY"):
    sys.exit(0)
args, hosts = sys.argv[1:], []
while args and args[0].startswith("-"):
    flag = args.pop(0)
    if flag in ("-f", "-l", "-u"):
        args.pop(0)
    elif flag == "-w":
        hosts = args.pop(0).split(",")
command = " ".join(args)
if command.lstrip().startswith("pkill"):
    sys.exit(0)
bare = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/")}
children = [subprocess.Popen(["bash", "-c", command.replace("%n", str(index))], env=bare, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for index in range(len(hosts))]
def stop(signum, frame):
    for child in children:
        if child.poll() is None:
            child.terminate()
    os._exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
import threading
def relay(host, child):
    for line in child.stdout:
        sys.stdout.write(f"{host}: {line}")
        sys.stdout.flush()
threads = [threading.Thread(target=relay, args=(host, child)) for host, child in zip(hosts, children)]
for thread in threads:
    thread.start()
codes = [child.wait() for child in children]
for thread in threads:
    thread.join()
sys.exit(max(codes, default=0))
'''

_SSH = _COMMON + '''
record("ssh")
args = sys.argv[1:]
while args and args[0].startswith("-"):
    flag = args.pop(0)
    if flag in ("-o", "-p", "-i", "-l"):
        args.pop(0)
args.pop(0)  # the host
sys.exit(subprocess.call(["bash", "-c", " ".join(args)]))
'''

_RECORD_ONLY = _COMMON + '''
record(os.path.basename(sys.argv[0]))
if os.path.basename(sys.argv[0]) == "mpiname":
    print("MVAPICH2-GDR 2.3.7")
'''

PROGRAMS = {"pdsh": _PDSH, "ssh": _SSH, "mpirun": _RECORD_ONLY, "srun": _RECORD_ONLY, "ompi_info": _RECORD_ONLY,
            "sinfo": _RECORD_ONLY, "mpiname": _RECORD_ONLY}


def install(folder: Path, names=tuple(PROGRAMS)) -> Path:
    """Write the fakes into `folder` (run by this interpreter) and return it, to put first on PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = folder / name
        path.write_text(f"#!{sys.executable}\n{PROGRAMS[name]}")
        path.chmod(0o755)
    return folder


def calls(log: Path) -> list[dict]:
    """The recorded calls, in order."""
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def path_with(folder: Path) -> str:
    return os.pathsep.join([str(folder), os.environ.get("PATH", "")])
