"""What is secret, and how it is hidden: the one rule every output path applies.

A variable is secret when its name is a known credential (AWS keys, Hugging Face and tracker tokens) or
contains a secret-looking word (TOKEN, PASSWORD, API_KEY, ...). Plans show such values as ***, the
config model leaves them out of what Prefect stores, and a Redactor blanks their values in process
output, job logs and results. Config, launchers and flows all import this module; it imports nothing
of the package, so it can sit below all of them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "***"

#: Env names whose values are secrets: shown as *** in plans, logs and artifacts
SECRET_ENV_NAMES: frozenset[str] = frozenset(
    {
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
        "HUGGINGFACE_HUB_TOKEN", "WANDB_API_KEY", "COMET_API_KEY", "NEPTUNE_API_TOKEN", "MLFLOW_TRACKING_PASSWORD",
    }
)


_SECRET_WORDS = re.compile(r"(SECRET|TOKEN|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL)", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    """Whether an environment variable's value must never be shown: known names, or a secret-looking word."""
    return name in SECRET_ENV_NAMES or bool(_SECRET_WORDS.search(name))


def redact_mapping(data: Any) -> Any:
    """A copy of nested dicts/lists with the values of secret-named keys replaced by ***."""
    if isinstance(data, dict):
        return {k: ("***" if isinstance(k, str) and is_secret_name(k) else redact_mapping(v)) for k, v in data.items()}
    if isinstance(data, list):
        return [redact_mapping(v) for v in data]
    return data


class Redactor:
    """Replaces known secret values in output lines by ***; longest first, so a secret that contains
    another is replaced whole. Values under 4 characters are left alone (they would blank ordinary text)."""

    def __init__(self, values=()) -> None:  # noqa: ANN001 - any iterable of str
        self._values: list[str] = []
        self.add(values)

    def add(self, values) -> None:  # noqa: ANN001 - any iterable of str
        self._values = sorted({*self._values, *(v for v in values if v and len(v) >= 4)}, key=len, reverse=True)

    @property
    def values(self) -> tuple[str, ...]:
        """The values replaced, longest first."""
        return tuple(self._values)

    def __contains__(self, value: str) -> bool:
        return value in self._values

    def __call__(self, line: str) -> str:
        for value in self._values:
            if value in line:
                line = line.replace(value, REDACTED)
        return line


#: names (never values) of further variables a launch marks secret, passed to the processes that redact
#: for it (torchrun's rank-log writer, the watchdog)
SECRET_NAMES_ENV = "PREFECT_ACCELERATE_SECRET_NAMES"


def known_secret_values(*envs: Mapping[str, str]) -> list[str]:
    """The values of secret-named variables in these environments and in this process's own: what a user
    may paste into a command line (`--tok $HF_TOKEN`) and must never see echoed or stored."""
    marked = set(filter(None, os.environ.get(SECRET_NAMES_ENV, "").split(",")))
    return [value for env in (os.environ, *envs) for name, value in env.items()
            if value and (is_secret_name(name) or name in marked)]


def redact_argv(argv: Iterable[str], *envs: Mapping[str, str]) -> tuple[str, ...]:
    """`argv` with every known secret value (see known_secret_values) replaced by ***."""
    redact = Redactor(known_secret_values(*envs))
    return tuple(redact(arg) for arg in argv)
