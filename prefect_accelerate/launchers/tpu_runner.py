"""`python -m prefect_accelerate.launchers.tpu_runner ...`: the command a single-host TPU plan runs.

The module name is part of every TPU plan's command line (and of the golden files that pin them), so it
stays here while the code lives with its engine: engines/tpu/runner.py.
"""

import sys

if __name__ == "__main__":
    # the imported module's main, so MainFunction pickles as engines.tpu.runner.MainFunction, not __main__'s
    from prefect_accelerate.launchers.engines.tpu.runner import main

    sys.exit(main())
