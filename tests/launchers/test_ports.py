"""Rendezvous ports come from below the kernel's ephemeral range, where no outgoing connection is given one."""

from __future__ import annotations

import socket
import subprocess
import sys

from prefect_accelerate.launchers import ports


def test_the_port_is_free_and_below_the_ephemeral_range_over_many_draws():
    low, _ = ports._ephemeral_range()
    drawn = {ports.rendezvous_port() for _ in range(200)}
    assert all(1024 <= port < low for port in drawn)
    assert len(drawn) > 100  # drawn at random, not one fixed port two launches would share
    for port in list(drawn)[:20]:
        with socket.socket() as sock:
            sock.bind(("", port))  # free: a listener can take it


def test_a_port_someone_listens_on_is_never_given(monkeypatch):
    low, _ = ports._ephemeral_range()
    listeners = []
    for port in range(low - 64, low):  # take a whole narrow range...
        sock = socket.socket()
        try:
            sock.bind(("", port))
            sock.listen()
            listeners.append(sock)
        except OSError:
            sock.close()
    try:
        monkeypatch.setattr(ports, "_LISTEN_PORTS_FROM", low - 64)  # ...and draw only from it
        taken = {sock.getsockname()[1] for sock in listeners}
        for _ in range(20):
            assert ports.rendezvous_port() not in taken  # bind(0) is the last resort
    finally:
        for sock in listeners:
            sock.close()


def test_the_module_runs_alone_as_the_slurm_batch_script_runs_it():
    """The batch script feeds this module's source to the head node's Python: no package import may be needed."""
    import inspect

    program = inspect.getsource(ports) + "\nprint(rendezvous_port())\n"
    done = subprocess.run([sys.executable, "-I", "-"], input=program, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert 1024 <= int(done.stdout) < ports._ephemeral_range()[0]
