"""Child process for test_crash.py: rewrite a config file slowly so that a kill can land mid-write.

`atomic`: run `prefect-accelerate config update` with every file write slowed down (chunked, with
sleeps). `naive`: rewrite the file in place the obvious way, equally slowly; the test uses it to show
that its kills do land inside writes (a naive writer leaves partial files).
"""

from __future__ import annotations

import os
import sys
import time

CHUNK = 256
PAUSE = 0.002


class SlowFile:
    def __init__(self, handle):
        self._handle = handle

    def write(self, data):
        for start in range(0, len(data), CHUNK):
            self._handle.write(data[start : start + CHUNK])
            self._handle.flush()
            time.sleep(PAUSE)
        return len(data)

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handle.close()


def main() -> int:
    mode, path = sys.argv[1], sys.argv[2]
    print("ready", flush=True)
    if mode == "naive":
        from prefect_accelerate.config.update import update_config_file  # noqa: F401  (same imports as atomic)

        new_text = open(sys.argv[3]).read()
        with SlowFile(open(path, "w")) as handle:
            handle.write(new_text)
        return 0
    real_fdopen = os.fdopen
    os.fdopen = lambda *a, **k: SlowFile(real_fdopen(*a, **k))
    from prefect_accelerate.cli.main import main as cli

    return cli(["config", "update", "--config_file", path])


if __name__ == "__main__":
    sys.exit(main())
