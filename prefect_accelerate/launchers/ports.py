"""A free TCP port for a rendezvous store, from below the kernel's ephemeral range. Standard library only: a
Slurm batch script runs this file's source on the head node, where only Python need exist (engines/slurm/plan.py).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: where `rendezvous_port` draws from when the kernel's ephemeral range leaves room below it
_LISTEN_PORTS_FROM = 20000


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out to `bind(0)` and to every outgoing connection (Linux:
    /proc/sys/net/ipv4/ip_local_port_range; its default where that cannot be read)."""
    try:
        low, high = (int(part) for part in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def rendezvous_port(address: str = "") -> int:
    """A free TCP port for a rendezvous store that binds it a little later, from below the kernel's ephemeral range.

    A port from `bind(0)` is ephemeral: between picking it and the store binding it, any outgoing connection on the
    machine (a Prefect client, another job's collectives) may be given the same port by the kernel, and the store
    fails with EADDRINUSE. Below that range the kernel gives a port only to an explicit bind, so only another
    listener can take it. Random draws are tried with a real bind; `bind(0)` is the last resort.
    """
    low, _ = _ephemeral_range()
    start = min(_LISTEN_PORTS_FROM, max(low - 1, 1024))
    candidates = list(range(start, low)) if low - start >= 64 else []
    for port in random.sample(candidates, min(len(candidates), 64)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((address, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])
