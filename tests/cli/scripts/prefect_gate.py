"""Runs `prefect-accelerate` with the first `import prefect` held back until the console has shown a given line.

GATE_LINE: the texts to wait for on this process's stdout, separated by `|`; GATE_RECORD: a JSON file written when the import goes
ahead ({"waited": true, "at": time.time()} or {"waited": false, ...} after GATE_TIMEOUT seconds). A tracked launch
that imported Prefect before it started the training would wait here until the timeout: the training could not
print the line before the import.
"""

import importlib.abc
import json
import os
import sys
import threading
import time

LINES = set(os.environ["GATE_LINE"].split("|"))
RECORD = os.environ["GATE_RECORD"]
TIMEOUT = float(os.environ.get("GATE_TIMEOUT", "120"))
seen = threading.Event()


class _Watched:
    """stdout, unchanged, except that writing the last of the awaited lines sets `seen`."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        for line in [line for line in LINES if line in text]:
            LINES.discard(line)
            if not LINES:
                self._stream.flush()
                seen.set()
        return written

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class _Gate(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ARG002
        if name == "prefect" or name.startswith("prefect."):
            sys.meta_path.remove(self)
            waited = seen.wait(TIMEOUT)
            with open(RECORD, "w") as handle:
                json.dump({"waited": waited, "at": time.time(), "module": name}, handle)
        return None


sys.stdout = _Watched(sys.stdout)
sys.meta_path.insert(0, _Gate())
sys.argv = ["prefect-accelerate", *sys.argv[1:]]

from prefect_accelerate.cli.main import entrypoint  # noqa: E402

entrypoint()
