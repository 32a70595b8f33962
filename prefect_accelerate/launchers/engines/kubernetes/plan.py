"""The Kubernetes plan: an Indexed Job and a headless Service, as pure data (no API server is called).

One pod per machine. The Job runs `completions = parallelism = num_machines` pods in Indexed mode, so
each pod has JOB_COMPLETION_INDEX (its node rank) and the hostname `<job>-<index>`; with the pod
template's `subdomain` set to the headless Service's name, pod 0 is reachable as `<job>-0.<service>`,
which is the rendezvous address every node's torchrun is given. `backoffLimit: 0` and a pod failure
policy fail the whole Job when any pod fails: a gang is never patched up with one restarted pod.

Each pod runs `python -m prefect_accelerate.launchers.engines.kubernetes.pod_entry ... -- <the launch>`:
it waits (bounded) for pod 0's name to resolve, puts its index after `--node_rank`, and becomes the
launch Accelerate would run on that machine (torchrun with the same environment as a local launch).
Secrets reach the pods only as `secretKeyRef` references (--kubernetes_secret_env); a secret value in
the launch's environment or arguments is refused, so no manifest ever holds one.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass

from prefect_accelerate.errors import UsageError
from prefect_accelerate.launchers.host import HostProbe, StaticHost
from prefect_accelerate.launchers.plan import LaunchPlan

CONTAINER = "trainer"
JOB_LABEL = "prefect-accelerate/job"
MANAGED_BY = ("app.kubernetes.io/managed-by", "prefect-accelerate")
INDEX_ENV = "JOB_COMPLETION_INDEX"
#: how the node rank is written in the manifest: Kubernetes expands it, and pod_entry checks or fills it in
INDEX_REF = f"$({INDEX_ENV})"
POD_PYTHON = "python"
ENTRY_MODULE = "prefect_accelerate.launchers.engines.kubernetes.pod_entry"
DEFAULT_NAMESPACE = "default"
#: the last defaults, after flags and the block: deployments/kubernetes/base-job-template.json sets them in a flow-run
#: pod to that pod's own image and namespace, so the training pods run what the flow runs, where it runs
IMAGE_ENV = "PREFECT_ACCELERATE_KUBERNETES_IMAGE"
NAMESPACE_ENV = "PREFECT_ACCELERATE_KUBERNETES_NAMESPACE"
#: the flow-run pod's name and uid (the base job template sets them from the downward API): a training Job in that
#: pod's namespace names the pod as its owner, so Kubernetes deletes the Job (and its pods) when the flow-run pod
#: goes, even if nothing in it ran a cleanup (a SIGKILL, a lost node)
OWNER_POD_ENV = "PREFECT_ACCELERATE_OWNER_POD"
OWNER_UID_ENV = "PREFECT_ACCELERATE_OWNER_POD_UID"
DEFAULT_PORT = 29500
DEFAULT_DNS_TIMEOUT = 600.0
#: DNS labels (pod hostnames, Job and Service names) are at most 63 characters
MAX_LABEL = 63
SHM_VOLUME = "dshm"
#: variables a local plan builds from this machine's paths (DeepSpeed's PYTHONPATH is the launching one plus the
#: working directory): in a pod they would name paths of the submitting machine and hide the image's own value
SUBMITTER_ONLY_ENV = ("PYTHONPATH",)

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


@dataclass(frozen=True)
class KubernetesSettings:
    """Where and how the pods run: flags win over the cluster block, which wins over our defaults."""

    image: str
    namespace: str = DEFAULT_NAMESPACE
    gpus_per_node: int = 0
    cpu_per_node: str | None = None
    memory_per_node: str | None = None
    service_account: str | None = None
    image_pull_secret: str | None = None
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[tuple[tuple[str, str], ...], ...] = ()
    secret_env: tuple[tuple[str, str, str], ...] = ()
    working_dir: str | None = None
    dns_timeout: float = DEFAULT_DNS_TIMEOUT
    #: the kubeconfig context the client uses (from the block only); None: the current one, or in-cluster
    context: str | None = None
    #: seconds pods may wait unscheduled before the job is deleted (None: no limit)
    pending_timeout: float | None = None
    #: (name, uid) of the flow-run pod that owns the Job, when the launch runs in such a pod in the same namespace
    owner_pod: tuple[str, str] | None = None


def _pick(flag, block_value, default=None):  # noqa: ANN001, ANN202
    return flag if flag not in (None, [], ()) else (block_value if block_value not in (None, [], (), {}) else default)


def settings_from(options) -> KubernetesSettings:
    """Merge the cluster block (when --kubernetes_block names one) under the flags, then the IMAGE_ENV and NAMESPACE_ENV
    defaults, and check every value."""
    block: dict = {}
    if options.kubernetes_block:
        from prefect_accelerate.launchers.engines.kubernetes.block import load_cluster_block

        block = load_cluster_block(options.kubernetes_block)
    image = _pick(options.kubernetes_image, block.get("image"), os.environ.get(IMAGE_ENV) or None)
    if not image:
        raise UsageError(
            "--kubernetes needs the container image every pod runs (with Python, torch, prefect-accelerate and your "
            "training script). Pass --kubernetes_image REGISTRY/IMAGE:TAG, save it as `image` in a KubernetesClusterBlock "
            f"named with --kubernetes_block, or set {IMAGE_ENV}."
        )
    namespace = _pick(options.kubernetes_namespace, block.get("namespace"), os.environ.get(NAMESPACE_ENV) or DEFAULT_NAMESPACE)
    _check(_DNS_LABEL.match(namespace) and len(namespace) <= MAX_LABEL, "--kubernetes_namespace", namespace,
           "a namespace is a DNS label: lower-case letters, digits and '-', at most 63 characters")
    gpus = int(_pick(options.kubernetes_gpus_per_node, block.get("gpus_per_node"), 0))
    _check(gpus >= 0, "--kubernetes_gpus_per_node", gpus, "it must be 0 or more")
    cpu = _pick(options.kubernetes_cpu_per_node, block.get("cpu_per_node"))
    memory = _pick(options.kubernetes_memory_per_node, block.get("memory_per_node"))
    for flag, value, example in (("--kubernetes_cpu_per_node", cpu, "8 or 7500m"), ("--kubernetes_memory_per_node", memory, "64Gi or 512Mi")):
        _check(value is None or _QUANTITY.match(str(value)), flag, value, f"write it as a Kubernetes quantity, e.g. {example}")
    for flag, value in (("--kubernetes_service_account", _pick(options.kubernetes_service_account, block.get("service_account"))),
                        ("--kubernetes_image_pull_secret", _pick(options.kubernetes_image_pull_secret, block.get("image_pull_secret")))):
        _check(value is None or (_DNS_SUBDOMAIN.match(value) and len(value) <= 253), flag, value,
               "a Kubernetes object name: lower-case letters, digits, '-' and '.'")
    selector = dict(block.get("node_selector") or {})
    selector.update(_pairs(options.kubernetes_node_selector or (), "--kubernetes_node_selector"))
    for key, value in selector.items():
        _check(_LABEL_KEY.match(key) and _LABEL_VALUE.match(value) and len(value) <= MAX_LABEL, "--kubernetes_node_selector",
               f"{key}={value}", "a node label KEY=VALUE (e.g. nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3)")
    tolerations = [_toleration_from_block(t) for t in block.get("tolerations") or ()]
    tolerations += [_toleration(text) for text in options.kubernetes_toleration or ()]
    secret_env: dict[str, tuple[str, str]] = {}
    for name, ref in (block.get("secret_env") or {}).items():
        secret_env[name] = _secret_ref(f"{name}={ref}")[1:]
    for text in options.kubernetes_secret_env or ():
        name, secret, key = _secret_ref(text)
        secret_env[name] = (secret, key)
    pending = _pick(options.kubernetes_pending_timeout, block.get("pending_timeout"))
    _check(pending is None or float(pending) > 0, "--kubernetes_pending_timeout", pending, "it must be a number of seconds above 0")
    timeout = float(_pick(options.kubernetes_dns_timeout, block.get("dns_timeout"), DEFAULT_DNS_TIMEOUT))
    _check(timeout > 0, "--kubernetes_dns_timeout", timeout, "it must be a number of seconds above 0")
    return KubernetesSettings(
        image=str(image), namespace=namespace, gpus_per_node=gpus, cpu_per_node=str(cpu) if cpu is not None else None,
        memory_per_node=str(memory) if memory is not None else None,
        service_account=_pick(options.kubernetes_service_account, block.get("service_account")),
        image_pull_secret=_pick(options.kubernetes_image_pull_secret, block.get("image_pull_secret")),
        node_selector=tuple(sorted(selector.items())), tolerations=tuple(tuple(t.items()) for t in tolerations),
        secret_env=tuple((name, secret, key) for name, (secret, key) in secret_env.items()),
        working_dir=_pick(options.kubernetes_working_dir, block.get("working_dir")), dns_timeout=timeout,
        context=block.get("context"), owner_pod=_owner_pod(namespace), pending_timeout=float(pending) if pending is not None else None,
    )


def _owner_pod(namespace: str) -> tuple[str, str] | None:
    name, uid = os.environ.get(OWNER_POD_ENV), os.environ.get(OWNER_UID_ENV)
    if not (name and uid) or os.environ.get(NAMESPACE_ENV) != namespace:
        return None  # an owner must be in the same namespace as what it owns
    return name, uid


def _check(ok, flag: str, value, why: str) -> None:  # noqa: ANN001
    if not ok:
        raise UsageError(f"{flag} {value!r} is not valid: {why}. Fix the value (or the KubernetesClusterBlock's) and run the command again.")


def _pairs(items, flag: str) -> dict[str, str]:  # noqa: ANN001
    out = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        _check(sep and key, flag, item, "write it as KEY=VALUE")
        out[key] = value
    return out


def _toleration(text: str) -> dict[str, str]:
    """kubectl's taint syntax: KEY=VALUE:EFFECT (Equal), KEY:EFFECT or KEY (Exists); no effect means every effect."""
    body, _, effect = text.rpartition(":") if ":" in text else (text, "", "")
    key, sep, value = body.partition("=")
    _check(key and _LABEL_KEY.match(key), "--kubernetes_toleration", text, "write a taint as KEY=VALUE:EFFECT, KEY:EFFECT or KEY")
    _check(not effect or effect in _EFFECTS, "--kubernetes_toleration", text, f"the effect is one of {', '.join(_EFFECTS)}")
    out = {"key": key, "operator": "Equal" if sep else "Exists"}
    if sep:
        out["value"] = value
    if effect:
        out["effect"] = effect
    return out


def _toleration_from_block(value) -> dict[str, str]:  # noqa: ANN001
    if isinstance(value, str):
        return _toleration(value)
    allowed = {"key", "operator", "value", "effect", "tolerationSeconds"}
    _check(isinstance(value, dict) and set(value) <= allowed, "tolerations (block)", value,
           f"each toleration is a taint string or a mapping with {', '.join(sorted(allowed))}")
    return dict(value)


def _secret_ref(text: str) -> tuple[str, str, str]:
    """NAME=SECRET:KEY -> (NAME, SECRET, KEY)."""
    name, sep, ref = str(text).partition("=")
    secret, colon, key = ref.partition(":")
    _check(sep and colon and _ENV_NAME.match(name) and _DNS_SUBDOMAIN.match(secret) and _SECRET_KEY.match(key),
           "--kubernetes_secret_env", text, "write it as NAME=SECRET:KEY, e.g. HF_TOKEN=hf-token:token (a variable name, the "
           "Secret's name, the key inside it)")
    return name, secret, key


def job_name(script: str, run_dir: str, nodes: int) -> str:
    """`pa-<script>-<6 hex of the run folder>`: a DNS label short enough that `<job>-<last index>` is one too."""
    base = os.path.basename(str(script).rstrip("/")) or "launch"
    stem = re.sub(r"[^a-z0-9]+", "-", base.rsplit(".", 1)[0].lower() if base.endswith(".py") else base.lower()).strip("-")
    suffix = hashlib.sha256(run_dir.encode()).hexdigest()[:6]
    room = MAX_LABEL - len(f"-{max(nodes - 1, 0)}") - len("pa--") - len(suffix)
    stem = stem[:max(room, 0)].rstrip("-")
    return f"pa-{stem}-{suffix}" if stem else f"pa-{suffix}"


def rendezvous_host(name: str) -> str:
    """Pod 0's DNS name inside the namespace: its hostname, then the headless Service (the pods' subdomain)."""
    return f"{name}-0.{name}"


def _cpu_cores(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(re.sub(r"[A-Za-z]+$", "", quantity))


def _in_package(script: str) -> str | None:
    """A script shipped inside prefect-accelerate (the self-test) as its module name: the image installs the package
    somewhere else, but `python -m` finds it there."""
    import prefect_accelerate

    root = os.path.dirname(os.path.abspath(prefect_accelerate.__file__))
    path = os.path.abspath(script)
    if not path.endswith(".py") or os.path.commonpath([root, path]) != root:
        return None
    parts = os.path.relpath(path[:-3], os.path.dirname(root)).split(os.sep)
    return ".".join(parts)


def pod_launch(options, host: HostProbe, settings: KubernetesSettings, name: str, cwd: str) -> LaunchPlan:
    """The launch one pod runs (node rank 0 stands for every node), planned for the pod, not this machine."""
    from prefect_accelerate.launchers import choose_launcher
    from prefect_accelerate.launchers.engines import engine_for_route
    from prefect_accelerate.launchers.engines.torchrun import DEFAULT_TEE, plan_torchrun

    machines = int(options.num_machines or 1)
    processes = int(options.num_processes or 1)
    port = int(options.main_process_port) if options.main_process_port else DEFAULT_PORT
    changes: dict = {"kubernetes": False, "num_machines": machines, "machine_rank": 0, "main_process_port": port,
                     "main_process_ip": rendezvous_host(name) if machines > 1 else None, "run_dir": None}
    if not options.is_given("tee") and str(options.tee) == "0":
        changes["tee"] = DEFAULT_TEE  # rank-prefixed lines, so every pod's log labels its ranks
    if settings.cpu_per_node and not options.is_given("num_cpu_threads_per_process"):
        changes["num_cpu_threads_per_process"] = max(int(_cpu_cores(settings.cpu_per_node) // max(processes // machines, 1)), 1)
    module = None if options.module or options.no_python else _in_package(options.training_script)
    if module:
        changes.update(module=True, training_script=module)
    inner = options.with_changes(**changes)
    gpus = settings.gpus_per_node
    pod = StaticHost(kind="cuda" if gpus else None, count=gpus, cores=host.physical_cores(), python_path=POD_PYTHON)
    kind = choose_launcher(inner, pod)
    if kind in ("tpu", "sagemaker", "slurm"):
        raise UsageError(f"--kubernetes runs the launch in pods, but these options select the {kind} launcher. Drop "
                         "--kubernetes, or use a config for GPUs or CPUs (multi_gpu, FSDP, DeepSpeed, --cpu).")
    if kind == "deepspeed":
        from prefect_accelerate.launchers.engines.deepspeed.plan import launcher_kind

        if machines > 1 and launcher_kind(inner) != "torchrun":
            raise UsageError(
                f"deepspeed_multinode_launcher {inner.deepspeed_multinode_launcher} starts the processes itself (over ssh, "
                "MPI or Slurm); in a Kubernetes Job every pod starts its own, so use `standard` (torchrun with DeepSpeed's "
                "environment on every node): --deepspeed_multinode_launcher standard, or change it in the config file.")
    if kind == "simple" and (machines > 1 or processes > 1):
        launch = plan_torchrun(inner, pod, cwd, None, cpu=not gpus)  # several machines always need torchrun
    else:
        launch = engine_for_route(kind).planner()(inner, pod, cwd=cwd, run_dir=None)
    dropped = [name for name in SUBMITTER_ONLY_ENV if name in launch.env]
    if dropped:
        launch = launch.model_copy(update={
            "env": {k: v for k, v in launch.env.items() if k not in dropped},
            "notes": (*launch.notes, f"{', '.join(dropped)} is left to the image: the value here names this machine's paths."),
        })
    if launch.files:
        raise UsageError(f"This launch ({launch.launcher}) writes files before it starts ({', '.join(launch.files)}), which "
                         "cannot reach the pods. Use torchrun-based settings (multi_gpu, FSDP, DeepSpeed `standard`).")
    return launch


def _check_no_secret_values(launch: LaunchPlan, options) -> None:
    from prefect_accelerate.secrets import known_secret_values

    named = [k for k in launch.env if launch.is_secret(k)]
    if named:
        raise UsageError(
            f"The launch would put the secret variable {named[0]} into the Job's manifest, where anyone who can read Jobs "
            f"sees it. Store it in a Kubernetes Secret and pass --kubernetes_secret_env {named[0]}=SECRET:KEY instead.")
    values = known_secret_values()
    for arg in options.training_script_args:
        if any(value in str(arg) for value in values if len(value) >= 4):
            raise UsageError(
                "A script argument holds the value of a secret variable of this environment (a token or password); a "
                "Job's manifest is readable by anyone who can read Jobs, so it is not submitted. Read the secret from "
                "the environment in the script, and pass it with --kubernetes_secret_env NAME=SECRET:KEY.")


def _with_index(argv: tuple[str, ...]) -> list[str]:
    out = list(argv)
    for i in range(1, len(out)):
        if out[i - 1] == "--node_rank":
            out[i] = INDEX_REF
    return out


def _resources(settings: KubernetesSettings) -> dict:
    amounts = {}
    if settings.cpu_per_node:
        amounts["cpu"] = settings.cpu_per_node
    if settings.memory_per_node:
        amounts["memory"] = settings.memory_per_node
    limits = dict(amounts)
    if settings.gpus_per_node:
        limits["nvidia.com/gpu"] = str(settings.gpus_per_node)
    out = {}
    if limits:
        out["limits"] = limits
    if amounts:
        out["requests"] = dict(amounts)
    return out


def manifests(launch: LaunchPlan, settings: KubernetesSettings, name: str, machines: int, port: int) -> tuple[dict, dict]:
    """The headless Service and the Indexed Job, as the API takes them (dicts)."""
    labels = {MANAGED_BY[0]: MANAGED_BY[1], JOB_LABEL: name}
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": settings.namespace, "labels": dict(labels)},
        "spec": {
            "clusterIP": "None",
            "selector": {JOB_LABEL: name},
            # the pods' names resolve while they start, not only once they are Ready: the nodes wait for pod 0 before
            # anything listens
            "publishNotReadyAddresses": True,
            "ports": [{"name": "rendezvous", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }
    env = [{"name": k, "value": v} for k, v in launch.env.items() if k != "PYTHONUNBUFFERED"]
    env.append({"name": "PYTHONUNBUFFERED", "value": "1"})  # lines reach the pod's log as they are printed
    env += [{"name": var, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}} for var, secret, key in settings.secret_env]
    entry = [POD_PYTHON, "-m", ENTRY_MODULE, "--wait-for", rendezvous_host(name), "--timeout", f"{settings.dns_timeout:g}",
             "--index-env", INDEX_ENV, "--nodes", str(machines), "--"]
    container: dict = {
        "name": CONTAINER, "image": settings.image, "command": entry, "args": _with_index(launch.argv), "env": env,
        "ports": [{"name": "rendezvous", "containerPort": port, "protocol": "TCP"}],
        "volumeMounts": [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}],
        # a failed pod's status carries the end of its log (the error), readable without the log API
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if settings.working_dir:
        container["workingDir"] = settings.working_dir
    resources = _resources(settings)
    if resources:
        container["resources"] = resources
    pod_spec: dict = {
        "subdomain": name, "restartPolicy": "Never", "containers": [container],
        # torch's DataLoader workers and NCCL share memory through /dev/shm, which a container gets at 64 MiB
        "volumes": [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}],
    }
    if settings.service_account:
        pod_spec["serviceAccountName"] = settings.service_account
    if settings.image_pull_secret:
        pod_spec["imagePullSecrets"] = [{"name": settings.image_pull_secret}]
    if settings.node_selector:
        pod_spec["nodeSelector"] = dict(settings.node_selector)
    if settings.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in settings.tolerations]
    job_meta: dict = {"name": name, "namespace": settings.namespace, "labels": dict(labels)}
    if settings.owner_pod:
        job_meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": settings.owner_pod[0], "uid": settings.owner_pod[1]}]
    job = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": job_meta,
        "spec": {
            "completionMode": "Indexed", "completions": machines, "parallelism": machines,
            # one failed pod fails the Job (and the Job controller ends the other pods): never a patched-up world
            "backoffLimit": 0,
            "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "NotIn", "values": [0]}}]},
            "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
        },
    }
    return service, job


def plan(options, host: HostProbe, *, cwd: str, run_dir: str | None) -> LaunchPlan:
    """The Kubernetes plan: a headless Service and an Indexed Job, in `request["manifests"]`, each pod's command as argv.

    Raises:
        UsageError: no image, a malformed flag value, options that cannot run in pods (TPU, SageMaker, an ssh-based
        DeepSpeed launcher), --slurm with --kubernetes, or a secret value that would land in a manifest.
    """
    from prefect_accelerate.launchers.state import new_run_dir

    if getattr(options, "slurm", False):
        raise UsageError("--slurm and --kubernetes both choose where the launch runs; keep one of them.")
    run_dir = os.path.abspath(run_dir or str(new_run_dir("kubernetes")))
    machines = int(options.num_machines or 1)
    settings = settings_from(options)
    name = job_name(options.training_script, run_dir, machines)
    launch = pod_launch(options, host, settings, name, cwd)
    _check_no_secret_values(launch, options)
    port = int(options.main_process_port) if options.main_process_port else DEFAULT_PORT
    service, job = manifests(launch, settings, name, machines, port)
    container = job["spec"]["template"]["spec"]["containers"][0]
    return LaunchPlan(
        launcher="kubernetes",
        argv=(*container["command"], *container["args"]),
        env={},
        cwd=settings.working_dir or cwd,
        num_processes=int(launch.num_processes),
        num_machines=machines,
        run_dir=run_dir,
        warnings=launch.warnings,
        notes=(*launch.notes, f"Each of the {machines} pods runs the {launch.launcher} launch above with its node rank from "
               f"{INDEX_ENV}; pod 0 is {rendezvous_host(name)}:{port}."),
        request={"job_name": name, "namespace": settings.namespace, "service_name": name, "rendezvous": rendezvous_host(name),
                 "port": port, "node_launcher": launch.launcher, "context": settings.context,
                 "pending_timeout": settings.pending_timeout, "manifests": [service, job]},
    )
