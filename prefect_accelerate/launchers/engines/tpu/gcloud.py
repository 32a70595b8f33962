"""The `gcloud compute tpus tpu-vm` commands we build for TPU pods and `tpu-config`, as pure functions.

Accelerate builds one gcloud command itself (`tpu-config`, reference §8) and leaves pod launches to
torch_xla's removed `xla_dist`; here both use the same builders. The argument order is Accelerate's
(`ssh NAME --zone Z --command C --worker all`), so `tpu-config --debug` prints exactly what it prints.

Where the pod is comes from, in this order: explicit values (flags, or a `TpuPod` passed from Python),
a Prefect block (`TpuPodBlock`, loaded by name only when one is named), then the config file.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from prefect_accelerate.errors import UsageError

GCLOUD = "gcloud"
#: environment variable naming a saved TpuPodBlock to read the pod's name/zone/project from
TPU_BLOCK_ENV = "PREFECT_ACCELERATE_TPU_BLOCK"


class TpuPod(BaseModel):
    """Where a TPU VM pod is: what every gcloud command needs to reach all of its workers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    zone: str
    project: str | None = None
    #: `gcloud alpha ...` (tpu-config's --use_alpha)
    use_alpha: bool = False
    #: reach the workers through their internal addresses (launching from a VM in the same network)
    internal_ip: bool = False

    def base(self) -> list[str]:
        return [GCLOUD, *(["alpha"] if self.use_alpha else []), "compute", "tpus", "tpu-vm"]

    def location(self) -> list[str]:
        out = ["--zone", self.zone]
        if self.project:
            out += ["--project", self.project]
        return out


def ssh_argv(pod: TpuPod, command: str, *, worker: str = "all") -> list[str]:
    """`gcloud [alpha] compute tpus tpu-vm ssh NAME --zone Z [--project P] [--internal-ip] --command C --worker all`."""
    argv = [*pod.base(), "ssh", pod.name, *pod.location()]
    if pod.internal_ip:
        argv.append("--internal-ip")
    return [*argv, "--command", command, "--worker", worker]


def scp_argv(pod: TpuPod, sources: Sequence[str], destination: str, *, recurse: bool = False, worker: str = "all") -> list[str]:
    """`gcloud [alpha] compute tpus tpu-vm scp SRC... NAME:DEST --zone Z [--project P] --worker all [--recurse]`."""
    argv = [*pod.base(), "scp", *sources, f"{pod.name}:{destination}", *pod.location()]
    if pod.internal_ip:
        argv.append("--internal-ip")
    argv += ["--worker", worker]
    if recurse:
        argv.append("--recurse")
    return argv


def load_pod_block(block_name: str) -> dict:
    """Name, zone, project... from a saved `TpuPodBlock` (imports Prefect; needs its API)."""
    from prefect_accelerate.blocks import TpuPodBlock

    try:
        block = TpuPodBlock.load(block_name)
    except ValueError as error:
        raise UsageError(
            f"Could not load the TPU pod block {block_name!r}: {error}. Save one first, e.g. "
            f"`TpuPodBlock(tpu_name='my-pod', tpu_zone='us-central2-b').save({block_name!r})`, or pass the pod's "
            "name and zone directly."
        ) from None
    return block.pod_values()


def resolve_pod(
    *,
    name: str | None,
    zone: str | None,
    project: str | None = None,
    use_alpha: bool = False,
    internal_ip: bool = False,
    block: str | None = None,
    config_name: str | None = None,
    config_zone: str | None = None,
    what: str = "the TPU pod",
) -> TpuPod:
    """A TpuPod from explicit values, then a block, then the config; a clear error when name or zone is missing.

    Raises:
        UsageError: no pod name or no zone anywhere (Accelerate passed None to gcloud and crashed).
    """
    from_block: dict = load_pod_block(block) if block else {}
    values = {
        "name": name or from_block.get("name") or config_name,
        "zone": zone or from_block.get("zone") or config_zone,
        "project": project or from_block.get("project"),
        "use_alpha": bool(use_alpha or from_block.get("use_alpha")),
        "internal_ip": bool(internal_ip or from_block.get("internal_ip")),
    }
    missing = [label for key, label in (("name", "name (--tpu_name)"), ("zone", "zone (--tpu_zone)")) if not values[key]]
    if missing:
        raise UsageError(
            f"No {' and no '.join(missing)} was given for {what}. Pass {' and '.join(m.split(' ')[1].strip('()') for m in missing)}, "
            "set tpu_name/tpu_zone in the config file (`prefect-accelerate config`), or name a saved TpuPodBlock "
            f"(--tpu_block, or {TPU_BLOCK_ENV})."
        )
    return TpuPod(**values)
