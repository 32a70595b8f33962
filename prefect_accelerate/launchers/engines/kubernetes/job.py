"""A Kubernetes launch's lifecycle through the official `kubernetes` client: submit, follow, stop, report.

`KubernetesJobRun` is the handle on one Indexed Job (made by `submit(plan)` or `attach(name, namespace)`):
- submit creates the Job, then the headless Service with the Job as its owner, so deleting the Job
  deletes the Service too;
- status comes from the Job's conditions (Complete, Failed) and its pods' phases;
- logs are read from EVERY pod (not only rank 0's), each line labelled `node N rank R` (the node is the
  pod's completion index, the rank comes from torchrun's `[defaultK]:` prefix);
- stop deletes the Job with foreground propagation and waits until neither the Job nor any of its pods
  is left;
- result names the failing pod's node, rank, exit code and last lines.

`run_job(plan, ...)` is what `execute()` calls for a Kubernetes plan. A deadline, Ctrl-C, SIGTERM or a
Prefect cancellation deletes the job before the exception goes on; the job is recorded so the flow's
cancellation hook deletes it too (`delete_recorded_jobs`). A pod that can never start (its image cannot
be pulled, a Secret it reads is missing) fails the launch at once, with the job deleted.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from prefect_accelerate.errors import USAGE_EXIT_CODE, DependencyError, LaunchError
from prefect_accelerate.launchers.engines.kubernetes.plan import CONTAINER, JOB_LABEL
from prefect_accelerate.launchers.plan import LaunchPlan
from prefect_accelerate.launchers.result import TIMEOUT_EXIT_CODE, LaunchResult, RankFailure, parse_rank_failures
from prefect_accelerate.launchers.state import read_records, remove_record, write_record
from prefect_accelerate.secrets import Redactor
from prefect_accelerate.launchers.joblog import emit_job_line, open_run_log

POLL_SECONDS = 2.0
#: how long stop() waits for the Job and every pod to be gone (the pods' grace period is 30 s by default)
STOP_WAIT_SECONDS = 90.0
TAIL_LINES = 200
#: polls in a row the API may fail to answer (5xx, 429, a dropped connection) before following the job gives up
API_OUTAGE_POLLS = 30
#: lines of the failing pod's log a result carries
FAILURE_LINES = 20
KUBERNETES_JOBS = "kubernetes-jobs"
INDEX_KEY = "batch.kubernetes.io/job-completion-index"
#: container waiting reasons that never clear by themselves: the launch fails at once instead of waiting forever
NEVER_STARTS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError", "CreateContainerError"})
#: Stopped: deleted by this handle; Deleted: gone from the API while it ran (a cancellation hook, kubectl delete)
FINAL = ("Succeeded", "Failed", "Stopped", "Deleted")
#: torchrun's --tee prefix: "[default3]:"
_RANK_PREFIX = re.compile(r"^\[(?P<role>[A-Za-z_][\w-]*?)(?P<rank>\d+)\]:")

LineCallback = Callable[[str, str], None]


class KubernetesPod(BaseModel):
    """One pod of the job as last seen."""

    name: str
    node: int | None = None
    phase: str = "Unknown"
    exit_code: int | None = None
    reason: str | None = None
    message: str | None = None
    finished_at: str | None = None
    #: placed on a node (its PodScheduled condition is True, or it ran)
    scheduled: bool = False
    #: why the scheduler has not placed it yet (PodScheduled False: Unschedulable and the scheduler's message)
    unscheduled: str | None = None


class KubernetesJob(BaseModel):
    """What the API says about the job (and, once it ended, which pod, node and rank failed and why)."""

    name: str
    namespace: str
    state: str
    reason: str | None = None
    message: str | None = None
    pods: list[KubernetesPod] = Field(default_factory=list)
    exit_code: int | None = None
    failed_pod: str | None = None
    failed_node: int | None = None
    failed_rank: int | None = None
    error: str | None = None
    failed_tail: list[str] = Field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.state in FINAL


class KubernetesLaunchResult(LaunchResult):
    job: KubernetesJob | None = None


def api_client(context: str | None = None):  # noqa: ANN201 - kubernetes.client.ApiClient
    """A client for the cluster: the pod's service account inside a cluster, else the kubeconfig (KUBECONFIG or
    ~/.kube/config, its current context or `context`)."""
    import os

    try:
        from kubernetes import client, config
    except ImportError:
        from prefect_accelerate.launchers.engines import ENGINES

        raise DependencyError.missing(*ENGINES["kubernetes"].client) from None
    if os.environ.get("KUBERNETES_SERVICE_HOST") and context is None:
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    try:
        # KUBECONFIG read now: the client reads it once, when it is first imported
        return config.new_client_from_config(config_file=os.environ.get("KUBECONFIG") or None, context=context)
    except Exception as error:  # kubeconfig missing or unreadable: ConfigException, OSError, yaml errors
        raise LaunchError(
            f"No Kubernetes cluster to submit to: the kubeconfig could not be read ({error}). Point KUBECONFIG at a "
            "kubeconfig (`kubectl config view` should show it), run inside a cluster, or use --dry-run to see the manifests.",
            exit_code=USAGE_EXIT_CODE) from None


def _api_error(error: Exception, what: str) -> LaunchError:
    status = getattr(error, "status", None)
    reason = getattr(error, "reason", None) or type(error).__name__
    body = getattr(error, "body", None) or ""
    try:
        import json

        body = json.loads(body).get("message", body)
    except (ValueError, AttributeError, TypeError):
        pass
    hint = {403: " The account has no right to do this: grant it create/get/list/delete on jobs, services, pods and "
                 "pods/log in the namespace (deployments/kubernetes/rbac.yaml).",
            404: " Check --kubernetes_namespace: the namespace must exist.",
            409: " An object with that name exists already: delete it, or use another --run_dir (the name is derived from it)."}
    return LaunchError(f"Kubernetes refused to {what} (HTTP {status} {reason}: {body}).{hint.get(status, '')}", exit_code=USAGE_EXIT_CODE)


def _transient(error: Exception) -> bool:
    """An API answer that may go away by itself: overload, a restart, a dropped connection."""
    status = getattr(error, "status", None)
    return status in (429, 500, 502, 503, 504) or (status is None and type(error).__module__.split(".")[0] == "urllib3")


def _when(text: str | None) -> dt.datetime | None:
    if not text:
        return None
    with contextlib.suppress(ValueError):
        return dt.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    return None


def stamp_key(stamp: str) -> tuple:
    """A log timestamp (RFC 3339 with up to 9 fraction digits, trailing zeros dropped) as a comparable key."""
    match = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?Z$", stamp)
    if match is None:
        return ("",)
    return (match.group(1), (match.group(2) or "").ljust(9, "0"))


class KubernetesJobRun:
    """A handle on one Kubernetes Indexed Job: status, every pod's logs, waiting, deleting, the outcome.

        job = KubernetesJobRun.submit(plan_launch(options))      # or KubernetesJobRun.attach("pa-train-1a2b3c", "ml")
        with job:                                                # an exception in the block deletes the job
            job.wait(timeout=3600)
        print(job.result().state)

    Lines go to `output(label, line)` (else the Prefect run logger) with known secret values replaced by ***.
    """

    def __init__(self, name: str, namespace: str, *, client: Any = None, context: str | None = None,
                 output: LineCallback | None = None, poll_seconds: float = POLL_SECONDS, secrets: list[str] | None = None,
                 processes_per_node: int = 1) -> None:
        self.name = name
        self.namespace = namespace
        self.poll_seconds = poll_seconds
        self.processes_per_node = max(int(processes_per_node), 1)
        self._client = client if client is not None else api_client(context)
        self._output = output
        self._redact = Redactor(secrets or [])
        self._seen: dict[str, tuple[tuple, int]] = {}  # pod -> (last timestamp, lines with that timestamp already taken)
        self._read_at: dict[str, float] = {}
        self._seen_state: str | None = None
        self.pod_tails: dict[str, deque[str]] = {}
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.last: KubernetesJob | None = None
        self.stopped = False
        #: the API has shown this Job (created or read): a 404 afterwards means someone deleted it
        self.existed = False
        #: set by run_job when its deadline deleted the job
        self.timed_out = False

    # --- the API ----------------------------------------------------------------------------------

    @property
    def batch(self):  # noqa: ANN201
        from kubernetes import client

        return client.BatchV1Api(self._client)

    @property
    def core(self):  # noqa: ANN201
        from kubernetes import client

        return client.CoreV1Api(self._client)

    # --- making one ---------------------------------------------------------------------------------

    @classmethod
    def submit(cls, plan: LaunchPlan, **kwargs: Any) -> KubernetesJobRun:
        """Create the Job, then its headless Service (owned by the Job); a refusal is a LaunchError (exit 2)."""
        request = plan.request or {}
        service, job = (dict(m) for m in request["manifests"])
        kwargs.setdefault("context", request.get("context"))
        kwargs.setdefault("processes_per_node", max(plan.num_processes // max(plan.num_machines, 1), 1))
        run = cls(request["job_name"], request["namespace"], **kwargs)
        try:
            created = run.batch.create_namespaced_job(run.namespace, job)
        except Exception as error:
            if getattr(error, "status", None) is None:
                raise
            raise _api_error(error, f"create Job {run.name} in namespace {run.namespace}") from None
        run.existed = True
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": run.name, "uid": created.metadata.uid,
                 "controller": True, "blockOwnerDeletion": True}
        service = {**service, "metadata": {**service["metadata"], "ownerReferences": [owner]}}
        try:
            run.core.create_namespaced_service(run.namespace, service)
        except Exception as error:
            with contextlib.suppress(Exception):  # a Job whose pods can never find pod 0 must not be left behind
                run._delete()
            if getattr(error, "status", None) is None:
                raise
            raise _api_error(error, f"create Service {run.name} in namespace {run.namespace}") from None
        return run

    @classmethod
    def attach(cls, name: str, namespace: str = "default", **kwargs: Any) -> KubernetesJobRun:
        """A handle on a job that already exists (submitted by another process)."""
        run = cls(name, namespace, **kwargs)
        if run.describe().state == "Unknown":
            raise LaunchError(f"Kubernetes has no Job {name} in namespace {namespace}. Check with `kubectl get jobs -n {namespace}`.",
                              exit_code=USAGE_EXIT_CODE)
        return run

    # --- looking at it -------------------------------------------------------------------------------

    def pods(self) -> list[KubernetesPod]:
        found = self.core.list_namespaced_pod(self.namespace, label_selector=f"{JOB_LABEL}={self.name}")
        pods = []
        for item in found.items or []:
            meta = item.metadata
            index = (meta.labels or {}).get(INDEX_KEY) or (meta.annotations or {}).get(INDEX_KEY)
            pod = KubernetesPod(name=meta.name, node=int(index) if str(index or "").isdigit() else None,
                                phase=(item.status.phase if item.status else None) or "Unknown")
            for condition in (item.status.conditions or []) if item.status else []:
                if condition.type == "PodScheduled" and condition.status == "True":
                    pod.scheduled = True
                elif condition.type == "PodScheduled" and condition.status == "False":
                    pod.unscheduled = f"{condition.reason}: {condition.message}" if condition.message else condition.reason
            pod.scheduled = pod.scheduled or pod.phase in ("Running", "Succeeded", "Failed")
            for status in (item.status.container_statuses or []) if item.status else []:
                if status.name != CONTAINER or status.state is None:
                    continue
                if status.state.terminated is not None:
                    done = status.state.terminated
                    pod.exit_code, pod.reason, pod.message = done.exit_code, done.reason, done.message
                    pod.finished_at = done.finished_at.isoformat() if hasattr(done.finished_at, "isoformat") else done.finished_at
                elif status.state.waiting is not None:
                    pod.reason, pod.message = status.state.waiting.reason, status.state.waiting.message
            pods.append(pod)
        return sorted(pods, key=lambda p: (p.node if p.node is not None else 1 << 30, p.name))

    def describe(self) -> KubernetesJob:
        """The job's state now: its conditions when it ended, else Running once a pod runs, else Pending."""
        try:
            job = self.batch.read_namespaced_job(self.name, self.namespace)
        except Exception as error:
            if getattr(error, "status", None) != 404:
                raise
            state = "Stopped" if self.stopped else ("Deleted" if self.existed else "Unknown")
            self.last = KubernetesJob(name=self.name, namespace=self.namespace, state=state,
                                      pods=self.last.pods if self.last else [])
            return self.last
        self.existed = True
        pods = self.pods()
        state, reason, message = "Pending", None, None
        for condition in (job.status.conditions or []) if job.status else []:
            if condition.status != "True":
                continue
            if condition.type == "Complete":
                state, reason, message = "Succeeded", condition.reason, condition.message
            elif condition.type == "Failed":
                state, reason, message = "Failed", condition.reason, condition.message
        if state == "Pending" and any(p.phase == "Running" for p in pods):
            state = "Running"
        if self.stopped and state not in ("Succeeded", "Failed"):
            state = "Stopping"
        self.last = KubernetesJob(name=self.name, namespace=self.namespace, state=state, reason=reason, message=message, pods=pods)
        return self.last

    @property
    def status(self) -> str:
        """The engine protocol's status: Pending, Running, Succeeded, Failed, Stopping, Stopped, Deleted (or Unknown)."""
        return self.last.state if self.last else "Unknown"

    @property
    def state(self) -> str:
        return self.status

    @property
    def finished(self) -> bool:
        return self.status in FINAL

    def label(self, node: int | None, line: str) -> tuple[str, str]:
        """(`node N rank R`, text) for a training line, (`node N`, text) for the pod's other lines."""
        where = f"node {node}" if node is not None else "pod"
        match = _RANK_PREFIX.match(line)
        if match is None or node is None:
            return where, line
        return f"{where} rank {node * self.processes_per_node + int(match.group('rank'))}", line[match.end():]

    def _pod_lines(self, pod: KubernetesPod) -> list[str]:
        """Lines of one pod's log not taken yet (timestamps tell them apart; only the recent part is fetched)."""
        kwargs: dict[str, Any] = {"container": CONTAINER, "timestamps": True}
        last_read = self._read_at.get(pod.name)
        if last_read is not None:
            kwargs["since_seconds"] = int(time.monotonic() - last_read) + 60  # overlap; repeats are dropped below
        try:
            text = self.core.read_namespaced_pod_log(pod.name, self.namespace, **kwargs)
        except Exception as error:
            if getattr(error, "status", None) in (400, 404):
                return []  # not started yet, or gone
            raise
        self._read_at[pod.name] = time.monotonic()
        previous, taken = self._seen.get(pod.name, ((), 0))
        current, count = previous, 0
        out: list[str] = []
        for raw in str(text or "").splitlines():
            stamp, _, line = raw.partition(" ")
            key = stamp_key(stamp)
            if key < previous:
                continue  # read before (the fetch overlaps the last one)
            if key != current:
                current, count = key, 0
            count += 1
            if key == previous and count <= taken:
                continue  # the same instant as the last line taken, and already taken
            out.append(line)
        self._seen[pod.name] = (current, max(count, taken) if current == previous else count)
        return out

    def new_log_lines(self) -> list[tuple[str, str]]:
        """The engine protocol's output: (label, line) for every pod's lines written since the last call, redacted."""
        pods = self.last.pods if self.last else self.pods()
        out = []
        for pod in pods:
            for raw in self._pod_lines(pod):
                label, line = self.label(pod.node, raw)
                line = self._redact(line)
                self.pod_tails.setdefault(pod.name, deque(maxlen=TAIL_LINES)).append(line)
                out.append((label, line))
        return out

    def emit(self, label: str, line: str) -> None:
        emit_job_line(self._output, self.tail, label, self._redact(line))

    def poll(self) -> KubernetesJob:
        """One round: state, then every pod's new lines (labelled), then a line when the state changed."""
        job = self.describe()
        for label, line in self.new_log_lines():
            self.emit(label, line)
        if job.state != self._seen_state:
            running = sum(p.phase == "Running" for p in job.pods)
            extra = f" ({job.reason})" if job.reason else (f" ({running} of {len(job.pods)} pods running)" if job.pods else "")
            self.emit("kubernetes", f"job {self.namespace}/{self.name}: {job.state}{extra}")
            self._seen_state = job.state
        return job

    def never_starts(self) -> KubernetesPod | None:
        """A pod stuck in a state that does not clear by itself (bad image, missing Secret), if any."""
        return next((p for p in (self.last.pods if self.last else []) if p.phase == "Pending" and p.reason in NEVER_STARTS), None)

    # --- waiting, stopping, the outcome --------------------------------------------------------------------

    def wait(self, timeout: float | None = None, *, until: Callable[[KubernetesJob], bool] | None = None) -> KubernetesJob:
        """Follow the job until it ends, a pod can never start, `until(job)` holds, or `timeout` seconds pass. The API being briefly away
        (5xx, 429, a dropped connection) is waited out for up to API_OUTAGE_POLLS rounds; a refusal ends the wait."""
        deadline = time.monotonic() + timeout if timeout is not None else None
        outage = 0
        while True:
            try:
                job = self.poll()
                outage = 0
            except Exception as error:
                if not _transient(error) or outage >= API_OUTAGE_POLLS:
                    if getattr(error, "status", None) is not None:
                        raise _api_error(error, f"read Job {self.name} and its pods") from None
                    raise
                outage += 1
                self.emit("kubernetes", f"the API did not answer ({type(error).__name__} {getattr(error, 'status', '') or ''}); trying again")
                time.sleep(self.poll_seconds)
                continue
            if job.finished or job.state == "Unknown" or self.never_starts() is not None or (until is not None and until(job)):
                return job
            if deadline is not None and time.monotonic() >= deadline:
                return job
            time.sleep(self.poll_seconds)

    def _delete(self) -> None:
        from kubernetes import client

        body = client.V1DeleteOptions(propagation_policy="Foreground")
        for call, kind in ((self.batch.delete_namespaced_job, "Job"), (self.core.delete_namespaced_service, "Service")):
            try:
                call(self.name, self.namespace, body=body)
            except Exception as error:
                status = getattr(error, "status", None)
                if status is None:
                    raise
                if status != 404:  # 404: gone already (the Service goes with its Job)
                    raise _api_error(error, f"delete {kind} {self.name}") from None

    def stop(self, wait_seconds: float = STOP_WAIT_SECONDS) -> KubernetesJob:
        """Delete the Job (foreground: its pods go first) and its Service; wait until no pod of it is left."""
        if self.last is not None:
            self.pod_tails_before_stop()
        self.emit("kubernetes", f"Deleting job {self.namespace}/{self.name} and its pods (propagationPolicy Foreground)")
        self.stopped = True
        self._delete()
        deadline = time.monotonic() + wait_seconds
        while True:
            job = self.describe()
            left = job.pods if job.state != "Stopped" else self.pods()
            if job.state == "Stopped" and not left:
                self.last = job.model_copy(update={"pods": self.last.pods if self.last else []})
                self.emit("kubernetes", f"job {self.namespace}/{self.name}: deleted, no pod left")
                return self.last
            if time.monotonic() >= deadline:
                self.emit("kubernetes", f"job {self.namespace}/{self.name}: still {len(left)} pod(s) after {wait_seconds:g} s")
                return job
            time.sleep(min(self.poll_seconds, 1.0))

    def pod_tails_before_stop(self) -> None:
        with contextlib.suppress(Exception):  # the last lines are worth having, not worth failing the stop for
            for label, line in self.new_log_lines():
                self.emit(label, line)

    def result(self) -> KubernetesJob:
        """The finished job with, for a failure, the failing pod's node, rank, exit code and last lines."""
        job = self.last if self.finished else self.describe()
        if not job.finished:
            raise LaunchError(f"Kubernetes job {self.name} is still {job.state}: wait for it first.")
        if job.state == "Succeeded":
            return job
        failed = [p for p in job.pods if p.exit_code not in (None, 0)]
        if not failed:
            return job
        # the pod that ended on its own failed first; the Job controller then ends the others (137 or 143)
        failed.sort(key=lambda p: (p.exit_code in (137, 143), _when(p.finished_at) or dt.datetime.max.replace(tzinfo=dt.timezone.utc)))
        pod = failed[0]
        lines = list(self.pod_tails.get(pod.name, ()))
        if not lines:
            with contextlib.suppress(Exception):
                text = self.core.read_namespaced_pod_log(pod.name, self.namespace, container=CONTAINER, tail_lines=TAIL_LINES)
                lines = [self._redact(line) for line in str(text or "").splitlines()]
        plain = [_RANK_PREFIX.sub("", line) for line in lines]
        failures, _ = parse_rank_failures(plain)
        update: dict[str, Any] = {"failed_pod": pod.name, "failed_node": pod.node, "exit_code": pod.exit_code,
                                  "failed_tail": lines[-FAILURE_LINES:]}
        if failures:
            update["failed_rank"] = failures[0].rank
            if failures[0].exit_code > 0:
                update["exit_code"] = failures[0].exit_code  # the worker's own code (torchrun exits 1)
        message = (pod.message or "").strip().splitlines()
        error_lines = [line for line in plain if re.search(r"(Error|Exception|error:)", line)]
        text = (error_lines[-1] if error_lines else (message[-1] if message else None))
        update["error"] = self._redact(text.strip()) if text else None
        self.last = job.model_copy(update=update)
        return self.last

    def __enter__(self) -> KubernetesJobRun:
        return self

    def __exit__(self, kind, error, trace) -> None:  # noqa: ANN001
        if kind is not None and not self.finished:
            with contextlib.suppress(Exception):  # the original exception is the one to report
                self.stop()


def delete_recorded_jobs(flow_run_id: str | None = None) -> list[str]:
    """Hook helper: delete (foreground) the Kubernetes jobs recorded for `flow_run_id` (all when None). Idempotent."""
    deleted = []
    for data in read_records(KUBERNETES_JOBS, flow_run_id, this_host=False):
        where = f"{data.get('namespace')}/{data.get('job_name')}"
        try:
            run = KubernetesJobRun(data["job_name"], data["namespace"], context=data.get("context"))
            run.stopped = True
            run._delete()
        except Exception as error:  # the record stays, so the next hook (or a second cancel) tries again
            print(f"prefect-accelerate: could not delete Kubernetes job {where} ({error}); delete it with "
                  f"`kubectl delete job {data.get('job_name')} -n {data.get('namespace')} --cascade=foreground`.")
            continue
        deleted.append(where)
        with contextlib.suppress(FileNotFoundError):
            Path(data["_path"]).unlink()
    return deleted


def failure_text(job: KubernetesJob) -> str | None:
    if job.state == "Succeeded":
        return None
    where = []
    if job.failed_node is not None:
        where.append(f"node {job.failed_node} (pod {job.failed_pod})")
    if job.failed_rank is not None:
        where.append(f"rank {job.failed_rank}")
    if job.state == "Deleted":
        return (f"Kubernetes job {job.namespace}/{job.name} was deleted while it ran (a cancelled flow run's hook, or "
                "`kubectl delete`); its pods were ended with it.")
    text = f"Kubernetes job {job.namespace}/{job.name} ended {job.state}" + (f" ({job.reason})" if job.reason else "")
    if job.exit_code is not None:
        text += f" with exit code {job.exit_code}"
    text += (" on " + ", ".join(where)) if where else ""
    text += f": {job.error}" if job.error else ""
    if job.failed_tail:
        text += " Last lines of that pod: " + " | ".join(line.strip() for line in job.failed_tail[-5:] if line.strip())
    return text


def _all_placed(job: KubernetesJob, nodes: int) -> bool:
    return len(job.pods) >= nodes and all(p.scheduled for p in job.pods)


def _follow(run: KubernetesJobRun, output: LineCallback, timeout: float | None, grace: float, started: float,
            pending_timeout: float | None = None, nodes: int = 1) -> None:
    """Wait for the job: delete it at the deadline, at once when a pod can never start, or when some pods are still
    not scheduled after `pending_timeout` seconds (the others would hold their GPUs waiting for them)."""
    run.timed_out = False
    with run:  # an exception in here (Ctrl-C, SIGTERM, a cancellation) deletes the job
        output("kubernetes", f"Created job {run.namespace}/{run.name} and its headless Service")
        if pending_timeout:
            limit = pending_timeout if timeout is None else min(pending_timeout, max(timeout - (time.monotonic() - started), 0.0))
            job = run.wait(timeout=limit, until=lambda j: _all_placed(j, nodes))
            waiting = [p for p in job.pods if not p.scheduled]
            if not job.finished and not _all_placed(job, nodes) and time.monotonic() - started >= pending_timeout:
                run.stop()
                raise LaunchError(
                    f"{max(len(waiting), nodes - len(job.pods))} of the {nodes} pods of Kubernetes job {run.namespace}/{run.name} "
                    f"were still not scheduled after {pending_timeout:g} s"
                    + (f" (node {waiting[0].node}: {waiting[0].unscheduled or 'no reason given yet'})" if waiting else "")
                    + ", so the job was deleted "
                    "and no pod holds resources. Ask for fewer or smaller pods (--num_machines, --kubernetes_gpus_per_node, "
                    "--kubernetes_cpu_per_node, --kubernetes_memory_per_node), check --kubernetes_node_selector and "
                    "--kubernetes_toleration, or allow a longer --kubernetes_pending_timeout.", exit_code=USAGE_EXIT_CODE)
        remaining = None if timeout is None else max(timeout - (time.monotonic() - started), 0.0)
        run.wait(timeout=remaining)
        stuck = run.never_starts()
        if stuck is not None and not run.finished:
            run.stop()
            raise LaunchError(
                f"Pod {stuck.name} (node {stuck.node}) of Kubernetes job {run.namespace}/{run.name} can never start: "
                f"{stuck.reason}: {stuck.message or 'no message'}. The job was deleted and nothing is left running. Check "
                "--kubernetes_image (and --kubernetes_image_pull_secret), and that every Secret named by "
                "--kubernetes_secret_env exists in the namespace.", exit_code=USAGE_EXIT_CODE)
        if not run.finished:
            run.timed_out = True
            run.stop(wait_seconds=max(grace, STOP_WAIT_SECONDS))


def run_job(plan: LaunchPlan, *, on_line: LineCallback | None = None, timeout: float | None = None,
            grace: float = STOP_WAIT_SECONDS, flow_run_id: str | None = None, task_run_id: str | None = None,
            poll_seconds: float | None = None, client: Any = None) -> KubernetesLaunchResult:
    """Submit the plan's job and follow it to the end (or the deadline). Interrupts delete the job and re-raise.

    Returns:
        A KubernetesLaunchResult: the training's exit code (the failing worker's when torchrun names it, else the
        failing pod's), 124 when the deadline deleted the job, 1 for a job that failed without a pod's code.
    Raises:
        LaunchError (exit 2): no cluster configured, the API refused the Job or Service, a pod can never start, or
        pods were still unscheduled after --kubernetes_pending_timeout.
    """
    from prefect_accelerate.signals import sigterm_as_exception

    log_path = Path(plan.run_dir or ".", "launch.log")
    log = open_run_log(log_path, plan.run_dir)  # closed below

    def output(label: str, line: str) -> None:
        log.write(f"[{label}] {line}\n")
        log.flush()
        if on_line is not None:
            on_line(label, line)

    started = time.monotonic()
    run: KubernetesJobRun | None = None
    request = plan.request or {}
    record = f"{Path(plan.run_dir or '.').name}-{request.get('job_name')}"
    try:
        with sigterm_as_exception():
            # recorded before the Job exists: a process killed between the two calls still leaves a record to clean up by
            write_record(KUBERNETES_JOBS, record, {"job_name": request.get("job_name"), "namespace": request.get("namespace"),
                                                   "context": request.get("context"), "flow_run_id": flow_run_id,
                                                   "task_run_id": task_run_id})
            try:
                run = KubernetesJobRun.submit(plan, output=output, poll_seconds=poll_seconds or POLL_SECONDS, client=client)
                _follow(run, output, timeout, grace, started, request.get("pending_timeout"), plan.num_machines)
            finally:
                remove_record(KUBERNETES_JOBS, record)
    finally:
        log.close()
    job = run.result()
    message = failure_text(job)
    if run.timed_out:
        code, message = TIMEOUT_EXIT_CODE, f"Kubernetes job {job.namespace}/{job.name} was deleted at the deadline ({timeout} s)"
    elif job.state == "Succeeded":
        code = 0
    else:
        code = job.exit_code if job.exit_code else 1
    failed = [RankFailure(rank=job.failed_rank, exit_code=code)] if job.failed_rank is not None and code not in (0, TIMEOUT_EXIT_CODE) else []
    return KubernetesLaunchResult(
        launcher="kubernetes", command=f"Kubernetes job {job.namespace}/{job.name}: {plan.command_line()}", exit_code=code,
        launcher_exit_code=job.exit_code, failed_ranks=failed, root_cause_rank=job.failed_rank, error=message,
        duration_s=round(time.monotonic() - started, 3), run_dir=plan.run_dir, log_path=str(log_path),
        tail=(list(job.failed_tail) or list(run.tail))[-40:], timed_out=run.timed_out, job=job,
    )
