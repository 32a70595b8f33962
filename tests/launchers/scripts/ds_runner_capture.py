"""Run DeepSpeed's real runner (`deepspeed.launcher.runner.main`) for several planned launches in one process.

    python ds_runner_capture.py launches.json

launches.json is a list of {"cwd", "env", "args"}: the working directory, the complete environment and the
runner's arguments of a plan (what `prefect-accelerate launch` would start as `python -m
deepspeed.launcher.runner ARGS`). Importing DeepSpeed costs seconds, so the golden tests pay it once here.
The runner reads DS_ENV_FILE when it is imported; it is set again for each launch. Prints the exit
codes as a JSON list.
"""

import json
import os
import sys

launches = json.loads(open(sys.argv[1]).read())
os.environ["DS_ACCELERATOR"] = "cpu"
from deepspeed.launcher import runner  # noqa: E402

codes = []
for launch in launches:
    os.chdir(launch["cwd"])
    os.environ.clear()
    os.environ.update(launch["env"])
    runner.DEEPSPEED_ENVIRONMENT_NAME = os.environ.get("DS_ENV_FILE", ".deepspeed_env")
    try:
        runner.main(launch["args"])
        codes.append(0)
    except SystemExit as stop:
        codes.append(stop.code if isinstance(stop.code, int) else 1)
print(json.dumps(codes))
