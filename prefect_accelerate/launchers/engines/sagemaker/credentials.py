"""Where a SageMaker launch gets its AWS credentials, without ever writing a secret into a plan.

The plan records only the *source* (`CredentialSource`): a Prefect block by name, a profile, the
environment / default chain, or "flags". Keys given as `--aws_access_key_id/--aws_secret_access_key`
(accepted for compatibility with Accelerate) stay in this process's memory, in a vault keyed by the
launch, as `SecretStr`; so do secret values of the job's environment (HF_TOKEN...). They are unwrapped
only when the boto3 session or the job request is built, and never reach a command line, a log line,
a plan, an artifact or a result.

Order (first that applies): a block (`aws_credentials_block`, or $PREFECT_ACCELERATE_AWS_CREDENTIALS_BLOCK),
the key flags, the config's `profile`, then boto3's default chain (AWS_* variables, ~/.aws, instance role).
Accelerate uses the profile before the flags and has no default chain (it raises OSError).
"""

from __future__ import annotations

import threading
from typing import Literal

from pydantic import BaseModel, ConfigDict, SecretStr

from prefect_accelerate.errors import LaunchError, UsageError

AWS_BLOCK_ENV = "PREFECT_ACCELERATE_AWS_CREDENTIALS_BLOCK"


class CredentialSource(BaseModel):
    """How to build the boto3 session: never the secrets themselves."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: Literal["block", "flags", "profile", "environment"]
    block: str | None = None
    profile: str | None = None
    #: the vault entry holding flag keys and secret job variables (this process only)
    handle: str | None = None

    def describe(self) -> str:
        return {
            "block": f"the Prefect block {self.block!r}",
            "flags": "--aws_access_key_id/--aws_secret_access_key (kept in memory, never logged)",
            "profile": f"the AWS profile {self.profile!r}",
            "environment": "the environment (AWS_* variables, ~/.aws, or an instance role)",
        }[self.source]


class _Secrets(BaseModel):
    model_config = ConfigDict(frozen=True)

    access_key_id: SecretStr | None = None
    secret_access_key: SecretStr | None = None
    environment: dict[str, SecretStr] = {}


_VAULT: dict[str, _Secrets] = {}
_LOCK = threading.Lock()


def remember(handle: str, *, access_key_id: SecretStr | None = None, secret_access_key: SecretStr | None = None,
             environment: dict[str, SecretStr] | None = None) -> None:
    with _LOCK:
        _VAULT[handle] = _Secrets(access_key_id=access_key_id, secret_access_key=secret_access_key, environment=environment or {})


def add_environment(handle: str, environment: dict[str, SecretStr]) -> None:
    """Keep secret job variables for this launch (next to any flag keys already kept)."""
    with _LOCK:
        old = _VAULT.get(handle) or _Secrets()
        _VAULT[handle] = old.model_copy(update={"environment": {**old.environment, **environment}})


def secret_environment(handle: str | None) -> dict[str, SecretStr]:
    with _LOCK:
        entry = _VAULT.get(handle or "")
    return dict(entry.environment) if entry else {}


def secret_values(handle: str | None) -> list[str]:
    """Every secret this launch holds, for redacting output lines."""
    with _LOCK:
        entry = _VAULT.get(handle or "")
    if entry is None:
        return []
    values = [s.get_secret_value() for s in (entry.access_key_id, entry.secret_access_key) if s is not None]
    return values + [s.get_secret_value() for s in entry.environment.values()]


def forget(handle: str | None) -> None:
    with _LOCK:
        _VAULT.pop(handle or "", None)


def choose_source(options, *, profile: str | None, handle: str, block: str | None = None) -> CredentialSource:
    """Decide (and for flag keys, remember) where the credentials come from. Touches no network."""
    key_id, secret = options.aws_access_key_id, options.aws_secret_access_key
    if block:
        return CredentialSource(source="block", block=block)
    if (key_id is None) != (secret is None):
        given = "--aws_access_key_id" if key_id is not None else "--aws_secret_access_key"
        raise UsageError(
            f"Only {given} was given; SageMaker needs both keys. Prefer an AWS profile (profile in the config), the "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY variables, or a Prefect block, which keep keys off the command line."
        )
    if key_id is not None:
        with _LOCK:
            old = _VAULT.get(handle)
            _VAULT[handle] = _Secrets(access_key_id=_secret(key_id), secret_access_key=_secret(secret),
                                      environment=old.environment if old else {})
        return CredentialSource(source="flags", handle=handle)
    if profile:
        return CredentialSource(source="profile", profile=profile)
    return CredentialSource(source="environment")


def _secret(value) -> SecretStr:  # noqa: ANN001
    return value if isinstance(value, SecretStr) else SecretStr(str(value))


def load_block(name: str):
    """A saved credentials block: ours (`AccelerateAwsCredentials`), or any `type-slug/name` with `get_boto3_session`."""
    try:
        if "/" in name:
            from prefect.blocks.core import Block

            return Block.load(name)
        from prefect_accelerate.blocks import AccelerateAwsCredentials

        return AccelerateAwsCredentials.load(name)
    except ValueError as error:
        raise LaunchError(
            f"Could not load the AWS credentials block {name!r}: {error}. Save one first, e.g. "
            f"`AccelerateAwsCredentials(profile_name='research').save({name!r})`, or use a profile or the environment."
        ) from None


def boto_session(source: CredentialSource, region: str):
    """The boto3 session for `source` in `region`; secrets are unwrapped here and nowhere else.

    Raises:
        LaunchError: flag keys that this process no longer holds (the plan was made elsewhere).
    """
    import boto3

    if source.source == "block":
        block = load_block(source.block or "")
        if not hasattr(block, "get_boto3_session"):
            raise LaunchError(f"The block {source.block!r} cannot make an AWS session (it has no get_boto3_session).")
        session = block.get_boto3_session()
        if session.region_name == region:
            return session
        frozen = session.get_credentials().get_frozen_credentials()  # the config's region wins over the block's
        return boto3.Session(aws_access_key_id=frozen.access_key, aws_secret_access_key=frozen.secret_key,
                             aws_session_token=frozen.token, region_name=region)
    if source.source == "flags":
        with _LOCK:
            entry = _VAULT.get(source.handle or "")
        if entry is None or entry.access_key_id is None or entry.secret_access_key is None:
            raise LaunchError(
                "This SageMaker plan was made with --aws_access_key_id/--aws_secret_access_key, and the keys are not in "
                "this process any more: they are never stored in plans, and are kept in memory only until the launch that "
                "planned them has run once. Use an AWS profile, the environment or a Prefect block (AccelerateAwsCredentials), "
                "or plan again in this process."
            )
        return boto3.Session(aws_access_key_id=entry.access_key_id.get_secret_value(),
                             aws_secret_access_key=entry.secret_access_key.get_secret_value(), region_name=region)
    if source.source == "profile":
        return boto3.Session(profile_name=source.profile, region_name=region)
    return boto3.Session(region_name=region)
