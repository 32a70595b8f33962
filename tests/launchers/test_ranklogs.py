"""torchrun's per-rank logs written through the redactor (launchers/ranklogs.py), without torchrun around it."""

from __future__ import annotations

import os
import stat
import threading
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from prefect_accelerate.launchers.ranklogs import _start_pump, safe_cut
from prefect_accelerate.secrets import Redactor

SECRETS = [b"hf_sekrit_value_1234", b"AKIAEXAMPLEKEY9", b"sekrit"]


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.one_of(st.sampled_from(SECRETS), st.binary(max_size=30)), max_size=20), at=st.floats(0, 1))
def test_a_cut_never_splits_a_secret_so_both_sides_are_redacted_whole(pieces, at):
    data = b"".join(pieces)
    redact = Redactor([s.decode() for s in SECRETS])
    cut = safe_cut(data, int(len(data) * at), SECRETS)
    left, right = data[:cut], data[cut:]
    clean = lambda b: redact(b.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")  # noqa: E731
    whole = clean(left) + clean(right)
    assert all(secret not in whole for secret in SECRETS)


@settings(max_examples=30, deadline=None)
@given(lines=st.lists(st.tuples(st.text(max_size=40), st.sampled_from(["", "hf_sekrit_value_1234"])), max_size=30),
       chunk=st.integers(1, 64))
def test_what_a_worker_writes_into_the_pipe_reaches_the_file_redacted_and_owner_only(tmp_path_factory, lines, chunk):
    target = tmp_path_factory.mktemp("rank") / "stdout.log"
    redact = Redactor(["hf_sekrit_value_1234"])
    pipe = _start_pump(str(target), redact)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    text = "".join(f"{a}{b}\n" for a, b in lines).encode("utf-8", "surrogateescape")
    seen: list[bytes] = []
    stop = threading.Event()

    def watch() -> None:  # reads the file while it is written: no raw secret at any moment
        while not stop.is_set():
            seen.append(target.read_bytes())

    watcher = threading.Thread(target=watch)
    watcher.start()
    with open(pipe, "wb", buffering=0) as worker:  # what torchrun hands the worker as its stdout
        for start in range(0, len(text), chunk):
            worker.write(text[start:start + chunk])
    deadline = time.monotonic() + 30
    expected = redact(text.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")
    while (target.read_bytes() != expected or os.path.exists(pipe)) and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    watcher.join()
    assert target.read_bytes() == expected
    assert not os.path.exists(pipe)
    assert all(b"hf_sekrit_value_1234" not in snapshot for snapshot in seen)
