"""The lines a tracked launch prints before its Prefect run exists: held in order and handed over once, whatever
the moment the run attaches, while the output reader keeps adding lines from its own thread."""

from __future__ import annotations

import threading

from hypothesis import given, settings, strategies as st

from prefect_accelerate.launchers.linebuffer import LineBuffer


def _lines(count: int) -> list[tuple[str, str]]:
    return [(f"rank {i % 3}", f"line {i}") for i in range(count)]


@settings(max_examples=200, deadline=None)
@given(count=st.integers(min_value=0, max_value=400), attach_after=st.integers(min_value=0, max_value=400),
       switch=st.sampled_from([1e-6, 1e-4, 5e-3]))
def test_every_line_reaches_the_receiver_once_and_in_order_whenever_it_attaches(count, attach_after, switch):
    """A reader thread adds lines while the main thread attaches after some of them: nothing lost, repeated or
    reordered, and the held lines keep the times they came at (never later than a line after them)."""
    import sys

    previous = sys.getswitchinterval()
    sys.setswitchinterval(switch)  # vary how the two threads interleave
    try:
        buffer = LineBuffer()
        received: list[tuple[float, str, str]] = []
        some_added = threading.Event()
        lines = _lines(count)

        def reader() -> None:
            for number, (label, line) in enumerate(lines):
                buffer(label, line)
                if number + 1 >= attach_after:
                    some_added.set()
            some_added.set()

        thread = threading.Thread(target=reader)
        thread.start()
        some_added.wait(10)
        buffer.attach(lambda created, label, line: received.append((created, label, line)))
        thread.join(10)
    finally:
        sys.setswitchinterval(previous)
    assert [(label, line) for _, label, line in received] == lines
    times = [created for created, _, _ in received]
    assert times == sorted(times)
    assert buffer.held == 0


def test_lines_past_the_limit_drop_the_oldest_and_say_how_many_went_to_the_log_only():
    buffer = LineBuffer(limit=3)
    for label, line in _lines(5):
        buffer(label, line)
    received: list[tuple[str, str]] = []
    buffer.attach(lambda created, label, line: received.append((label, line)))
    assert received[0] == ("prefect-accelerate", "[prefect-accelerate] 2 earlier output line(s) are only in the run folder's launch.log")
    assert received[1:] == _lines(5)[2:]


def test_a_discarded_buffer_holds_nothing_and_a_later_attach_gets_nothing():
    buffer = LineBuffer()
    buffer("rank 0", "before")
    buffer.discard()
    buffer("rank 0", "after")
    received: list[str] = []
    buffer.attach(lambda created, label, line: received.append(line))
    buffer("rank 0", "later")
    assert received == [] and buffer.held == 0


def test_a_receiver_that_raises_does_not_stop_the_lines_after_it():
    buffer = LineBuffer()
    buffer("rank 0", "bad")
    buffer("rank 0", "good")
    received: list[str] = []

    def receiver(created: float, label: str, line: str) -> None:
        if line == "bad":
            raise RuntimeError("a broken log handler")
        received.append(line)

    buffer.attach(receiver)
    buffer("rank 1", "later")
    assert received == ["good", "later"]
