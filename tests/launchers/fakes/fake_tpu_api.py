"""A tiny Cloud TPU + Compute API on 127.0.0.1, enough for `gcloud compute tpus tpu-vm ssh|scp --dry-run`.

It knows one READY pod (any name) with two workers, 127.0.1.2 and 127.0.1.3, and logs each request.
Only for use inside `unshare -n` (see gcloud_dry_run.py): gcloud must never reach a real endpoint.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def node(path: str) -> dict:
    name = path.split("?")[0].split("/nodes/")[1].split(":")[0]
    return {"name": f"projects/fake-proj/locations/zone/nodes/{name}", "id": "1234567890", "state": "READY",
            "acceleratorType": "v4-16", "runtimeVersion": "tpu-ubuntu2204-base",
            "networkEndpoints": [{"ipAddress": f"127.0.1.{i}", "port": 8470, "accessConfig": {"externalIp": f"127.0.1.{i}"}}
                                 for i in (2, 3)]}


def serve(port: int, log: list[str]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            log.append(f"GET {self.path}")
            if "/nodes/" in self.path:
                return self._send(200, node(self.path))
            if self.path.startswith("/compute/v1/projects/"):
                return self._send(200, {"name": "fake-proj", "commonInstanceMetadata": {"items": []}})
            return self._send(404, {"error": {"code": 404, "message": "not found"}})

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            log.append(f"POST {self.path}")
            if "getGuestAttributes" in self.path:
                return self._send(200, {"guestAttributes": []})
            return self._send(404, {"error": {"code": 404, "message": "not found"}})

        def log_message(self, *args):  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
