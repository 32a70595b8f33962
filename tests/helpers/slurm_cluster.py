"""A real two-node Slurm 22.05 cluster on loopback, for tests and bench/ (spike-slurm.md).

`start_cluster(scratch)` installs slurm-wlm and munge with apt when they are missing (root only),
writes slurm.conf and cgroup.conf into the scratch folder (SLURM_CONF points there, /etc/slurm is left
alone), starts munged (unless one already runs), slurmctld and two `slurmd -N` daemons, and waits until
both nodes are idle. `Cluster.stop()` ends the daemons it started, by PID: TERM to all, then a wait,
then KILL to any left.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
#: daemons come up in about 2 s (spike §6); a loaded machine gets much more room
READY_SECONDS = 120.0
STOP_SECONDS = 15.0
NODES = ("n1", "n2")


class ClusterUnavailable(Exception):
    """Slurm cannot run here (no packages and no way to install them); tests skip with this reason."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _consecutive_free_ports(count: int) -> int:
    for _ in range(50):
        base = _free_port()
        if base + count > 65535:
            continue
        ok = True
        for port in range(base + 1, base + count):
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise ClusterUnavailable("no free consecutive ports for the slurmd daemons on 127.0.0.1")


def ensure_packages() -> None:
    """apt-get install slurm-wlm and munge when slurmctld or munged is missing; ClusterUnavailable if impossible."""
    if shutil.which("slurmctld", path="/usr/sbin:/usr/bin") and shutil.which("munged", path="/usr/sbin:/usr/bin"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise ClusterUnavailable("Slurm is not installed and apt-get cannot install it here (needs root and apt): "
                                 "apt-get install slurm-wlm munge")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    apt = ["apt-get", "-o", "DPkg::Lock::Timeout=600"]
    for command in ([*apt, "update"], [*apt, "install", "-y", *PACKAGES]):
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0 and command[-1] != "update":
            raise ClusterUnavailable(f"apt-get could not install {' '.join(PACKAGES)}: {done.stderr.strip()[-500:]}")


SLURM_CONF = """\
ClusterName=patest
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
AuthType=auth/munge
CredType=cred/munge
MailProg=/bin/true
ProctrackType=proctrack/cgroup
TaskPlugin=task/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
StateSaveLocation={scratch}/state
SlurmdSpoolDir={scratch}/spool/%n
SlurmctldPidFile={scratch}/run/slurmctld.pid
SlurmdPidFile={scratch}/run/slurmd-%n.pid
SlurmctldLogFile={scratch}/log/slurmctld.log
SlurmdLogFile={scratch}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmdParameters=config_overrides
InactiveLimit=0
KillWait=5
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=30
Waittime=0
NodeName=n[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port={node_port}-{node_port_end} CPUs=2 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
PartitionName=small Nodes=n1 MaxTime=INFINITE State=UP
"""

CGROUP_CONF = """\
CgroupPlugin=cgroup/v1
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
"""


@dataclass
class Cluster:
    scratch: Path
    conf: Path
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def log(self, name: str) -> str:
        path = self.scratch / "log" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        """TERM every daemon this cluster started, wait, KILL what is left (by PID only)."""
        for pid in self.pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + STOP_SECONDS
        while time.monotonic() < end and any(_alive(pid) for pid in self.pids.values()):
            time.sleep(0.1)
        for pid in self.pids.values():
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for node in NODES:  # the empty per-node cgroup trees slurmd leaves behind
            for tree in Path("/sys/fs/cgroup").glob(f"*/slurm_{node}"):
                with contextlib.suppress(OSError):
                    tree.rmdir()
        self.pids.clear()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _read_pid(path: Path, deadline: float) -> int:
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            return int(path.read_text().strip())
        time.sleep(0.05)
    raise ClusterUnavailable(f"{path} did not appear")


def _munged_pid() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        pid = int(Path("/run/munge/munged.pid").read_text().strip())
        if _alive(pid):
            return pid
    return None


def start_cluster(scratch: Path) -> Cluster:
    """Bring up munged (when none runs), slurmctld and slurmd n1, n2; return once both nodes are idle."""
    ensure_packages()
    if os.geteuid() != 0:
        raise ClusterUnavailable("the test cluster's slurmd daemons must run as root")
    scratch = Path(scratch)
    for sub in ("state", "spool/n1", "spool/n2", "log", "run"):
        (scratch / sub).mkdir(parents=True, exist_ok=True)
    node_port = _consecutive_free_ports(2)
    conf = scratch / "slurm.conf"
    conf.write_text(SLURM_CONF.format(scratch=scratch, ctld_port=_free_port(), node_port=node_port, node_port_end=node_port + 1))
    (scratch / "cgroup.conf").write_text(CGROUP_CONF)
    cluster = Cluster(scratch=scratch, conf=conf)
    env = {**os.environ, **cluster.env}
    deadline = time.monotonic() + READY_SECONDS
    try:
        if _munged_pid() is None:
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True, capture_output=True)
            cluster.pids["munged"] = _read_pid(Path("/run/munge/munged.pid"), deadline)
        subprocess.run(["/usr/sbin/slurmctld"], env=env, check=True, capture_output=True)
        cluster.pids["slurmctld"] = _read_pid(scratch / "run" / "slurmctld.pid", deadline)
        for node in NODES:
            subprocess.run(["/usr/sbin/slurmd", "-N", node], env=env, check=True, capture_output=True)
            cluster.pids[f"slurmd-{node}"] = _read_pid(scratch / "run" / f"slurmd-{node}.pid", deadline)
        while time.monotonic() < deadline:
            done = subprocess.run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%N %t"], env=env, capture_output=True, text=True)
            if done.returncode == 0 and sum(line.split()[-1] == "idle" for line in done.stdout.splitlines() if line.strip()) == len(NODES):
                return cluster
            time.sleep(0.2)
        raise ClusterUnavailable(f"both nodes were not idle within {READY_SECONDS:.0f} s; slurmctld log: "
                                 f"{cluster.log('slurmctld')[-1500:]}")
    except BaseException:
        cluster.stop()
        raise
