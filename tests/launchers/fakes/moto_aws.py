"""moto_server on 127.0.0.1 for SageMaker tests: start on a free port, reset, read what it received, stop by pid."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from helpers.processes import end_group

#: the SDK's own config: telemetry off (it would otherwise call a regional S3 URL)
SDK_CONFIG = "SchemaVersion: '1.0'\nSageMaker:\n  PythonSDK:\n    Modules:\n      TelemetryOptOut: true\n"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MotoServer:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> MotoServer:
        program = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
        log = open(self.folder / "moto.log", "wb")  # noqa: SIM115 - kept open for the server's lifetime
        self.process = subprocess.Popen([program, "-H", "127.0.0.1", "-p", str(self.port)], stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True, cwd=self.folder)  # its recorder writes into its cwd
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.url}/moto-api/", timeout=1).read()
                return self
            except OSError:
                if self.process.poll() is not None:
                    raise RuntimeError(f"moto_server exited: {(self.folder / 'moto.log').read_text()[-2000:]}") from None
                time.sleep(0.2)
        raise RuntimeError("moto_server did not start within 60 s")

    def stop(self) -> None:
        if self.process is not None:
            end_group(self.process)

    def post(self, path: str) -> None:
        urllib.request.urlopen(urllib.request.Request(f"{self.url}{path}", method="POST"), timeout=10).read()

    def reset(self) -> None:
        self.post("/moto-api/reset")
        self.post("/moto-api/recorder/reset-recording")
        self.post("/moto-api/recorder/start-recording")

    def recording(self) -> list[dict]:
        text = urllib.request.urlopen(f"{self.url}/moto-api/recorder/download-recording", timeout=10).read().decode()
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def sdk_environment(server: MotoServer, folder: Path) -> dict[str, str]:
    """What the SDK and boto3 need to talk to moto only, with telemetry off."""
    config = folder / "sagemaker-sdk.yaml"
    config.write_text(SDK_CONFIG)
    return {
        "AWS_ENDPOINT_URL": server.url,
        "AWS_ACCESS_KEY_ID": "testing-key-id",
        "AWS_SECRET_ACCESS_KEY": "testing-env-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "SAGEMAKER_VALIDATE_ROLE": "false",
        "SAGEMAKER_USER_CONFIG_OVERRIDE": str(config),
        "SAGEMAKER_ADMIN_CONFIG_OVERRIDE": str(config),
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
    }
