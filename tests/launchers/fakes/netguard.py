"""A guard that turns any network connection off this machine into an immediate test failure.

`sys.addaudithook` sees every `socket.connect` and `socket.getaddrinfo` in this process; while the guard
is on, a host that is not loopback raises PermissionError before a DNS query or a packet leaves, and is
remembered in `BLOCKED` so a test can assert that nothing was attempted. Audit hooks cannot be removed,
so the hook is installed once and switched with `guarded()`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import sys

BLOCKED: list[str] = []
_OWN_NAME = socket.gethostname()
_STATE = {"on": 0, "installed": False}


def _loopback(host) -> bool:  # noqa: ANN001
    if host is None:
        return True
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    text = str(host)
    if text in ("localhost", "", _OWN_NAME) or text.endswith(".localhost"):
        return True  # this machine's own name resolves through /etc/hosts, not the network
    try:
        return ipaddress.ip_address(text.split("%")[0]).is_loopback
    except ValueError:
        return False


def _hook(event: str, args) -> None:  # noqa: ANN001
    if not _STATE["on"]:
        return
    if event == "socket.connect":
        address = args[1]
        if isinstance(address, tuple) and address and not _loopback(address[0]):
            BLOCKED.append(f"connect {address}")
            raise PermissionError(f"test network guard: refused a connection to {address} (only loopback is allowed)")
    elif event == "socket.getaddrinfo":
        if not _loopback(args[0]):
            BLOCKED.append(f"getaddrinfo {args[0]}")
            raise PermissionError(f"test network guard: refused to resolve {args[0]!r} (only loopback is allowed)")


def install() -> None:
    if not _STATE["installed"]:
        sys.addaudithook(_hook)
        _STATE["installed"] = True


@contextlib.contextmanager
def guarded():
    install()
    _STATE["on"] += 1
    try:
        yield BLOCKED
    finally:
        _STATE["on"] -= 1
