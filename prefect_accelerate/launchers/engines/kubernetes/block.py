"""A Prefect block with a Kubernetes cluster's defaults, so flows and deployments name a cluster instead of flags.

    KubernetesClusterBlock(image="ghcr.io/acme/train:2026-12", namespace="ml", gpus_per_node=8,
                           node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                           tolerations=["nvidia.com/gpu:NoSchedule"],
                           secret_env={"HF_TOKEN": "hf-token:token"}).save("gpu-cluster")
    prefect-accelerate launch --kubernetes --kubernetes_block gpu-cluster --num_machines 4 --num_processes 32 train.py

Flags given on the command line win over the block's values (node selectors and secret variables are merged,
the flag's entry winning for the same key). The Accelerate config file gets no new keys.
"""

from __future__ import annotations

from typing import Any

from prefect.blocks.core import Block
from pydantic import Field


class KubernetesClusterBlock(Block):
    """Defaults for training jobs on one Kubernetes cluster: image, namespace, per-pod resources, scheduling."""

    _block_type_name = "Accelerate Kubernetes Cluster"
    _block_type_slug = "accelerate-kubernetes-cluster"

    image: str | None = Field(default=None, description="Container image of the pods (Python, torch, prefect-accelerate, the script)")
    namespace: str | None = Field(default=None, description="Namespace of the Job and Service")
    gpus_per_node: int | None = Field(default=None, description="nvidia.com/gpu per pod")
    cpu_per_node: str | None = Field(default=None, description="CPU per pod (8, 7500m)")
    memory_per_node: str | None = Field(default=None, description="Memory per pod (64Gi)")
    service_account: str | None = Field(default=None, description="Service account of the pods")
    image_pull_secret: str | None = Field(default=None, description="Secret to pull the image with")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pods must land on")
    tolerations: list[Any] = Field(default_factory=list, description="Taints tolerated: 'KEY=VALUE:EFFECT' strings or toleration mappings")
    secret_env: dict[str, str] = Field(default_factory=dict, description="NAME -> 'SECRET:KEY': variables read from Kubernetes Secrets")
    working_dir: str | None = Field(default=None, description="Working directory in the container")
    dns_timeout: float | None = Field(default=None, description="Seconds each pod waits for pod 0's DNS name")
    pending_timeout: float | None = Field(default=None, description="Delete the job if pods are still unscheduled after this many seconds")
    context: str | None = Field(default=None, description="kubeconfig context to submit with (default: the current one, or in-cluster)")


def load_cluster_block(name: str) -> dict[str, Any]:
    """The saved block's values as a dict; a missing block is one paragraph naming it and how to save one."""
    from prefect_accelerate.errors import ConfigError

    try:
        block = KubernetesClusterBlock.load(name)
    except ValueError as error:
        raise ConfigError(
            f"No KubernetesClusterBlock named {name!r} was found ({error}). Save one first, e.g. in Python: "
            f"KubernetesClusterBlock(image='ghcr.io/acme/train:1', namespace='ml').save({name!r}), or drop --kubernetes_block."
        ) from None
    return block.model_dump(exclude={"block_type_slug"}, exclude_none=True)
