"""`python -m prefect_accelerate.launchers.tpu_pod <tpu-pod.json>`: the command a TPU pod plan runs.

The module name is part of every pod plan's command line (and of the golden files that pin them), so it
stays here while the code lives with its engine: engines/tpu/pod.py.
"""

import sys

if __name__ == "__main__":
    from prefect_accelerate.launchers.engines.tpu.pod import main

    sys.exit(main())
