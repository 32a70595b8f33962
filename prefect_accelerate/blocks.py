"""Prefect blocks: where a TPU pod is, and the AWS credentials a SageMaker launch uses.

Secrets are `SecretStr` fields, unwrapped only at the moment a boto3 session is built (as prefect-aws
does), so a block can be logged or shown in the UI without exposing them. Importing this module imports
Prefect; the launchers load a block only when one is named.

Example:
    >>> from prefect_accelerate.blocks import AccelerateAwsCredentials, TpuPodBlock
    >>> TpuPodBlock(tpu_name="my-pod", tpu_zone="us-central2-b").save("pod")          # doctest: +SKIP
    >>> AccelerateAwsCredentials(profile_name="research").save("sagemaker")           # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from prefect.blocks.core import Block
from pydantic import Field, SecretStr


class TpuPodBlock(Block):
    """A Cloud TPU VM pod: what `launch --tpu_cluster` and `tpu-config` need to reach every worker."""

    _block_type_name = "Accelerate TPU Pod"
    _block_type_slug = "accelerate-tpu-pod"
    _description = "A Cloud TPU VM pod (name, zone, project) for prefect-accelerate's TPU pod launches and tpu-config."
    _code_example = 'TpuPodBlock(tpu_name="my-pod", tpu_zone="us-central2-b", project="my-project").save("pod")'

    tpu_name: str = Field(description="The TPU VM's name (gcloud compute tpus tpu-vm list).")
    tpu_zone: str = Field(description="The zone the TPU VM is in, e.g. us-central2-b.")
    project: str | None = Field(default=None, description="Google Cloud project; gcloud's configured one when empty.")
    use_alpha: bool = Field(default=False, description="Use `gcloud alpha`.")
    internal_ip: bool = Field(default=False, description="Reach the workers through their internal addresses.")

    def pod_values(self) -> dict[str, Any]:
        return {"name": self.tpu_name, "zone": self.tpu_zone, "project": self.project, "use_alpha": self.use_alpha,
                "internal_ip": self.internal_ip}


class AccelerateAwsCredentials(Block):
    """AWS credentials for SageMaker launches: keys (kept secret) or a profile name, and a region."""

    _block_type_name = "Accelerate AWS Credentials"
    _block_type_slug = "accelerate-aws-credentials"
    _description = "AWS credentials for prefect-accelerate's SageMaker launches. Keys are stored as secrets."
    _code_example = 'AccelerateAwsCredentials(profile_name="research", region_name="eu-west-1").save("sagemaker")'

    aws_access_key_id: SecretStr | None = Field(default=None, description="Access key id.")
    aws_secret_access_key: SecretStr | None = Field(default=None, description="Secret access key.")
    aws_session_token: SecretStr | None = Field(default=None, description="Session token for temporary credentials.")
    profile_name: str | None = Field(default=None, description="A profile from ~/.aws/config instead of keys.")
    region_name: str | None = Field(default=None, description="Region; the config file's region when empty.")

    def get_boto3_session(self, region_name: str | None = None):
        """A boto3 session; the secrets are unwrapped here and nowhere else."""
        import boto3

        def reveal(value: SecretStr | None) -> str | None:
            return value.get_secret_value() if value is not None else None

        return boto3.Session(
            aws_access_key_id=reveal(self.aws_access_key_id),
            aws_secret_access_key=reveal(self.aws_secret_access_key),
            aws_session_token=reveal(self.aws_session_token),
            profile_name=self.profile_name,
            region_name=region_name or self.region_name,
        )


__all__ = ["AccelerateAwsCredentials", "TpuPodBlock"]
