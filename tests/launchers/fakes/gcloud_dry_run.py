"""Run the real gcloud with `--dry-run` against fake_tpu_api, inside a network namespace of its own.

    unshare -rn python gcloud_dry_run.py <job.json> <out.json>

job.json: {"scratch": dir, "commands": [argv, ...]}. The namespace has only a loopback interface, so
nothing gcloud tries (the metadata server probe included) can leave this machine; its config is a scratch
folder. Writes {"outputs": [{"argv", "code", "stdout", "stderr"}], "api": [requests]}.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_tpu_api import serve  # noqa: E402


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text())
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    scratch = Path(job["scratch"])
    (scratch / "token").write_text("fake-token\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log: list[str] = []
    server = serve(port, log)
    api = f"http://127.0.0.1:{port}/"
    env = {
        "PATH": os.environ["PATH"], "HOME": str(scratch / "home"), "CLOUDSDK_CONFIG": str(scratch / "gcloud-config"),
        "CLOUDSDK_CORE_CHECK_GCE_METADATA": "false", "CLOUDSDK_CORE_DISABLE_USAGE_REPORTING": "true",
        "CLOUDSDK_COMPONENT_MANAGER_DISABLE_UPDATE_CHECK": "true", "CLOUDSDK_CORE_DISABLE_PROMPTS": "1",
        "CLOUDSDK_AUTH_ACCESS_TOKEN_FILE": str(scratch / "token"), "CLOUDSDK_CORE_PROJECT": "fake-proj",
        "CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU": api, "CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE": f"{api}compute/v1/",
        "CLOUDSDK_API_ENDPOINT_OVERRIDES_OSLOGIN": api,
    }
    outputs = []
    for argv in job["commands"]:
        done = subprocess.run([*argv, "--dry-run", "--ssh-key-file", str(scratch / "key")], env=env, capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)
        outputs.append({"argv": argv, "code": done.returncode, "stdout": done.stdout, "stderr": done.stderr})
    server.shutdown()
    Path(sys.argv[2]).write_text(json.dumps({"outputs": outputs, "api": log}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
