"""A Kubernetes API server on 127.0.0.1 that answers the calls the job handle makes, nothing more.

No API server can run on these machines, so this one (http.server in a thread) answers exactly the REST paths
the official `kubernetes` client calls for a launch, with objects shaped as the API documents them:

    POST   /apis/batch/v1/namespaces/{ns}/jobs              create the Job (201; 409 when the name exists)
    GET    /apis/batch/v1/namespaces/{ns}/jobs/{name}       the Job with status.conditions, active, succeeded, failed
    DELETE /apis/batch/v1/namespaces/{ns}/jobs/{name}       records the propagationPolicy; Foreground removes the pods
                                                            first, then the Job, then what it owns (its Service)
    POST   /api/v1/namespaces/{ns}/services                 create the Service
    DELETE /api/v1/namespaces/{ns}/services/{name}    answered with the deleted Service
    GET    /api/v1/namespaces/{ns}/pods?labelSelector=k=v   a PodList
    GET    /api/v1/namespaces/{ns}/pods/{name}/log          text; timestamps, sinceSeconds, tailLines honoured

Creating a Job creates its pods (Pending, one per completion index, labelled and annotated as the Job controller
does). Tests then move pods along (`run_pod`, `finish_pod`, `wait_pod`, `log`); the small controller here applies
the Job's podFailurePolicy / backoffLimit 0 as Kubernetes does: the first pod that exits non-zero fails the Job and
the others are terminated (exit code 143). Every request is kept in `requests` (method, path, query, body).
"""

from __future__ import annotations

import datetime as dt
import json
import secrets
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

INDEX_KEY = "batch.kubernetes.io/job-completion-index"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _stamp(when: dt.datetime, nano: bool = False) -> str:
    if nano:  # the log API's RFC 3339 with nanoseconds, trailing zeros dropped
        fraction = f"{when.microsecond:06d}000".rstrip("0")
        return when.strftime("%Y-%m-%dT%H:%M:%S") + (f".{fraction}" if fraction else "") + "Z"
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message, "reason": reason, "code": code}


class FakeKubernetes:
    """The fake API's state and its HTTP server; use as a context manager."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.jobs: dict[tuple[str, str], dict] = {}
        self.services: dict[tuple[str, str], dict] = {}
        self.pods: dict[tuple[str, str], dict] = {}
        self.logs: dict[tuple[str, str], list[tuple[dt.datetime, str]]] = {}
        self.requests: list[tuple[str, str, dict[str, list[str]], Any]] = []
        #: False: pods are created Pending and unplaced, as the scheduler has not seen them yet (run_pod places them)
        self.schedule_on_create = True
        #: jobs deleted in the foreground whose removal finishes on the next read (as the garbage collector does)
        self._deleting: set[tuple[str, str]] = set()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeKubernetes:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def kubeconfig(self, folder: Path) -> Path:
        """A kubeconfig file whose current context is this server (what `KUBECONFIG=...` points the client at)."""
        path = folder / "kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "fake-token-for-loopback"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tester", "namespace": "default"}}],
        }))
        return path

    # --- what tests do to the cluster ---------------------------------------------------------------------

    def pod_names(self, job: str, namespace: str = "default") -> list[str]:
        with self.lock:
            found = [p for (ns, _), p in self.pods.items() if ns == namespace and p["metadata"]["labels"].get("batch.kubernetes.io/job-name") == job]
            return [p["metadata"]["name"] for p in sorted(found, key=lambda p: int(p["metadata"]["annotations"][INDEX_KEY]))]

    def pod(self, job: str, index: int, namespace: str = "default") -> dict:
        return self.pods[(namespace, self.pod_names(job, namespace)[index])]

    def _container_status(self, pod: dict, state: dict, ready: bool) -> list[dict]:
        container = pod["spec"]["containers"][0]
        return [{"name": container["name"], "image": container["image"], "imageID": "", "ready": ready, "restartCount": 0,
                 "started": "running" in state, "state": state}]

    def run_pod(self, job: str, index: int, namespace: str = "default") -> None:
        with self.lock:
            pod = self.pod(job, index, namespace)
            pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "True"}]  # a running pod was placed
            pod["status"].update(phase="Running", startTime=_stamp(_now()),
                                 containerStatuses=self._container_status(pod, {"running": {"startedAt": _stamp(_now())}}, True))
            self._controller(namespace, job)

    def wait_pod(self, job: str, index: int, reason: str, message: str, namespace: str = "default") -> None:
        with self.lock:
            pod = self.pod(job, index, namespace)
            pod["status"]["containerStatuses"] = self._container_status(pod, {"waiting": {"reason": reason, "message": message}}, False)

    def unschedule_pod(self, job: str, index: int, message: str, namespace: str = "default") -> None:
        """The scheduler found no node for the pod (PodScheduled False, reason Unschedulable)."""
        with self.lock:
            pod = self.pod(job, index, namespace)
            pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message,
                                            "lastProbeTime": None, "lastTransitionTime": _stamp(_now())}]

    def log(self, job: str, index: int, *lines: str, namespace: str = "default") -> None:
        with self.lock:
            name = self.pod(job, index, namespace)["metadata"]["name"]
            self.logs.setdefault((namespace, name), []).extend((_now(), line) for line in lines)

    def finish_pod(self, job: str, index: int, exit_code: int, namespace: str = "default") -> None:
        with self.lock:
            self._terminate(self.pod(job, index, namespace), exit_code)
            self._controller(namespace, job)

    def _terminate(self, pod: dict, exit_code: int) -> None:
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        tail = "\n".join(line for _, line in self.logs.get(key, [])[-10:])
        done = {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error", "startedAt": _stamp(_now()),
                "finishedAt": _stamp(_now()), "containerID": f"containerd://{secrets.token_hex(8)}"}
        if exit_code != 0 and tail:
            done["message"] = tail  # terminationMessagePolicy: FallbackToLogsOnError
        pod["status"].update(phase="Succeeded" if exit_code == 0 else "Failed",
                             containerStatuses=self._container_status(pod, {"terminated": done}, False))

    def _controller(self, namespace: str, name: str) -> None:
        """The Job controller's part: counts, and FailJob on the first non-zero exit (backoffLimit 0)."""
        job = self.jobs.get((namespace, name))
        if job is None:
            return
        pods = [self.pods[(namespace, p)] for p in self.pod_names(name, namespace)]
        phases = [p["status"].get("phase") for p in pods]
        status = job["status"]
        status.update(active=sum(ph in ("Pending", "Running") for ph in phases), succeeded=phases.count("Succeeded"),
                      failed=phases.count("Failed"), ready=phases.count("Running"))
        if any(c["type"] in ("Complete", "Failed") for c in status.get("conditions", [])):
            return
        if "Failed" in phases:
            failing = pods[phases.index("Failed")]
            for pod in pods:
                if pod["status"].get("phase") in ("Pending", "Running"):
                    self._terminate(pod, 143)  # the controller deletes the rest of the gang
            code = failing["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"]
            status["conditions"] = [
                {"type": "FailureTarget", "status": "True", "reason": "PodFailurePolicy", "lastProbeTime": _stamp(_now()), "lastTransitionTime": _stamp(_now()),
                 "message": f"Container trainer for pod {namespace}/{failing['metadata']['name']} failed with exit code {code} matching FailJob rule at index 0"},
                {"type": "Failed", "status": "True", "reason": "PodFailurePolicy", "lastProbeTime": _stamp(_now()), "lastTransitionTime": _stamp(_now()),
                 "message": f"Container trainer for pod {namespace}/{failing['metadata']['name']} failed with exit code {code} matching FailJob rule at index 0"},
            ]
            status.update(active=0, failed=sum(p["status"]["phase"] == "Failed" for p in pods))
        elif phases and all(ph == "Succeeded" for ph in phases):
            status["conditions"] = [{"type": "Complete", "status": "True", "lastProbeTime": _stamp(_now()), "lastTransitionTime": _stamp(_now())}]
            status["completionTime"] = _stamp(_now())
            status["completedIndexes"] = f"0-{len(pods) - 1}" if len(pods) > 1 else "0"

    # --- the API ----------------------------------------------------------------------------------

    def _create_job(self, namespace: str, body: dict) -> tuple[int, dict]:
        name = body["metadata"]["name"]
        if (namespace, name) in self.jobs:
            return 409, _status(409, "AlreadyExists", f'jobs.batch "{name}" already exists')
        job = json.loads(json.dumps(body))
        job["metadata"].update(namespace=namespace, uid=secrets.token_hex(16), creationTimestamp=_stamp(_now()), resourceVersion="1")
        job["status"] = {"startTime": _stamp(_now()), "active": job["spec"]["parallelism"], "ready": 0}
        self.jobs[(namespace, name)] = job
        template = job["spec"]["template"]
        for index in range(job["spec"]["completions"]):
            pod_name = f"{name}-{index}-{secrets.token_hex(3)[:5]}"
            labels = {**template["metadata"].get("labels", {}), "batch.kubernetes.io/job-name": name, "job-name": name,
                      INDEX_KEY: str(index), "batch.kubernetes.io/controller-uid": job["metadata"]["uid"]}
            spec = json.loads(json.dumps(template["spec"]))
            spec["hostname"] = f"{name}-{index}"
            container = spec["containers"][0]
            container.setdefault("env", []).append(
                {"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": f"metadata.annotations['{INDEX_KEY}']"}}})
            self.pods[(namespace, pod_name)] = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod_name, "namespace": namespace, "uid": secrets.token_hex(16), "labels": labels,
                             "annotations": {INDEX_KEY: str(index)}, "creationTimestamp": _stamp(_now()),
                             "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": job["metadata"]["uid"],
                                                  "controller": True, "blockOwnerDeletion": True}]},
                "spec": spec,
                "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}] if self.schedule_on_create else []},
            }
        return 201, job

    def _delete_job(self, namespace: str, name: str, policy: str | None) -> tuple[int, dict]:
        job = self.jobs.get((namespace, name))
        if job is None:
            return 404, _status(404, "NotFound", f'jobs.batch "{name}" not found')
        if policy == "Foreground":
            # the garbage collector deletes the dependents (the pods) first; the Job stays readable, with
            # deletionTimestamp and the foregroundDeletion finalizer, until they are gone
            job["metadata"].update(deletionTimestamp=_stamp(_now()), finalizers=["foregroundDeletion"])
            for pod_name in self.pod_names(name, namespace):
                del self.pods[(namespace, pod_name)]
            self._deleting.add((namespace, name))
        else:  # Orphan / Background: the pods are left to be found (what --cascade=orphan would leave behind)
            del self.jobs[(namespace, name)]
        return 200, _status(200, "", "") | {"status": "Success", "details": {"name": name, "group": "batch", "kind": "jobs", "uid": job["metadata"]["uid"]}}

    def _settle(self) -> None:
        for key in list(self._deleting):
            job = self.jobs.pop(key, None)
            self._deleting.discard(key)
            if job is not None:  # what the Job owned (its Service) goes with it
                for skey, service in list(self.services.items()):
                    if any(o.get("uid") == job["metadata"]["uid"] for o in service["metadata"].get("ownerReferences", [])):
                        del self.services[skey]

    def handle(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> tuple[int, Any, str]:
        parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")]
        with self.lock:
            self.requests.append((method, path, query, body))
            if method == "GET":
                self._settle()
            if parts[:3] == ["apis", "batch", "v1"] and parts[3] == "namespaces" and parts[5] == "jobs":
                namespace = parts[4]
                if method == "POST" and len(parts) == 6:
                    return (*self._create_job(namespace, body), "json")
                name = parts[6]
                if method == "GET":
                    job = self.jobs.get((namespace, name))
                    return (200, job, "json") if job else (404, _status(404, "NotFound", f'jobs.batch "{name}" not found'), "json")
                if method == "DELETE":
                    policy = (body or {}).get("propagationPolicy") or (query.get("propagationPolicy") or [None])[0]
                    return (*self._delete_job(namespace, name, policy), "json")
            if parts[:2] == ["api", "v1"] and parts[2] == "namespaces":
                namespace, kind = parts[3], parts[4]
                if kind == "services":
                    if method == "POST":
                        name = body["metadata"]["name"]
                        if (namespace, name) in self.services:
                            return 409, _status(409, "AlreadyExists", f'services "{name}" already exists'), "json"
                        service = json.loads(json.dumps(body))
                        service["metadata"].update(namespace=namespace, uid=secrets.token_hex(16))
                        service["status"] = {"loadBalancer": {}}
                        self.services[(namespace, name)] = service
                        return 201, service, "json"
                    if method == "DELETE":  # answered with the deleted Service, as the API does
                        service = self.services.pop((namespace, parts[5]), None)
                        if service is None:
                            return 404, _status(404, "NotFound", f'services "{parts[5]}" not found'), "json"
                        return 200, service, "json"
                if kind == "pods" and method == "GET" and len(parts) == 5:
                    selector = (query.get("labelSelector") or [""])[0]
                    wanted = dict(item.split("=", 1) for item in selector.split(",") if item)
                    items = [p for (ns, _), p in self.pods.items() if ns == namespace and all(p["metadata"]["labels"].get(k) == v for k, v in wanted.items())]
                    return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "1"}, "items": items}, "json"
                if kind == "pods" and method == "GET" and len(parts) == 7 and parts[6] == "log":
                    pod = self.pods.get((namespace, parts[5]))
                    if pod is None:
                        return 404, _status(404, "NotFound", f'pods "{parts[5]}" not found'), "json"
                    if pod["status"]["phase"] == "Pending":
                        return 400, _status(400, "BadRequest", f'container "trainer" in pod "{parts[5]}" is waiting to start: ContainerCreating'), "json"
                    lines = self.logs.get((namespace, parts[5]), [])
                    if query.get("sinceSeconds"):
                        since = _now() - dt.timedelta(seconds=int(query["sinceSeconds"][0]))
                        lines = [(when, line) for when, line in lines if when >= since]
                    if query.get("tailLines"):
                        lines = lines[-int(query["tailLines"][0]):]
                    stamps = (query.get("timestamps") or ["false"])[0] == "true"
                    text = "".join((f"{_stamp(when, nano=True)} " if stamps else "") + line + "\n" for when, line in lines)
                    return 200, text, "text"
            return 404, _status(404, "NotFound", f"the fake API does not serve {method} {path}"), "json"

    def _handler(self):  # noqa: ANN202
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _serve(self, method: str) -> None:
                url = urllib.parse.urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                code, payload, kind = fake.handle(method, url.path, urllib.parse.parse_qs(url.query), body)
                data = payload.encode() if kind == "text" else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain" if kind == "text" else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                self._serve("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._serve("POST")

            def do_DELETE(self) -> None:  # noqa: N802
                self._serve("DELETE")

        return Handler
