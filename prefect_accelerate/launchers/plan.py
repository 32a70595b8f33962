"""LaunchPlan: exactly what a launch will run, as frozen, printable, comparable data.

A plan is the seam between "what" and "where" (STYLE.md, from TorchX): `--dry-run` prints it, the
launch task logs it, golden tests compare it, and only `process.py` or an engine's `submit` acts on it.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_serializer

from prefect_accelerate.secrets import REDACTED, Redactor, is_secret_name, known_secret_values, redact_argv




class LaunchPlan(BaseModel):
    """One command on one machine (or one remote job request), with the environment it adds."""

    model_config = ConfigDict(frozen=True)

    launcher: str
    argv: tuple[str, ...]
    #: variables added to or changed in the launching process's environment
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str
    #: env names whose values must never be shown (beyond the always-secret names)
    secret_env: frozenset[str] = frozenset()
    num_processes: int = 1
    num_machines: int = 1
    machine_rank: int = 0
    #: where logs, error files and state for this launch go
    run_dir: str | None = None
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    #: files the launch writes before starting (path -> content), e.g. DeepSpeed's .deepspeed_env;
    #: a relative path is relative to run_dir
    files: dict[str, str] = Field(default_factory=dict)
    #: for remote engines (SageMaker): the job request, JSON-able, secrets already left out
    request: dict[str, Any] | None = None
    #: the master port was not asked for (Accelerate's default 29500); it may be swapped for a free one
    implicit_port: bool = False

    def is_secret(self, name: str) -> bool:
        return name in self.secret_env or is_secret_name(name)

    @field_serializer("argv", when_used="json")
    def _argv_without_secrets(self, argv: tuple[str, ...]) -> list[str]:
        # `train.py --tok $HF_TOKEN`: stored flow parameters must not hold the token
        return list(self.shown_argv())

    @field_serializer("request", when_used="json")
    def _request_without_secrets(self, request: dict[str, Any] | None) -> dict[str, Any] | None:
        return self.shown_request()

    @field_serializer("env", when_used="json")
    def _env_without_secrets(self, env: dict[str, str]) -> dict[str, str]:
        # a plan passed as a flow parameter is stored by Prefect as JSON: secrets must not be
        return {k: (REDACTED if self.is_secret(k) else v) for k, v in env.items()}

    def shown_argv(self) -> tuple[str, ...]:
        """The command with known secret values (this environment's and the plan's) replaced by ***."""
        return redact_argv(self.argv, {k: v for k, v in self.env.items() if self.is_secret(k)})

    def shown_request(self) -> dict[str, Any] | None:
        """The remote job request with known secret values (e.g. a token among the script's hyperparameters) as ***."""
        if self.request is None:
            return None
        redact = Redactor(known_secret_values({k: v for k, v in self.env.items() if self.is_secret(k)}))
        return _redact_strings(self.request, redact)

    def redacted_env(self) -> dict[str, str]:
        return {k: (REDACTED if self.is_secret(k) else v) for k, v in self.env.items()}

    def to_json_dict(self) -> dict[str, Any]:
        """The `--dry-run --json` object: launcher, argv, env (added or changed, secrets redacted), cwd."""
        data: dict[str, Any] = {"launcher": self.launcher, "argv": list(self.shown_argv()), "env": self.redacted_env(), "cwd": self.cwd}
        if self.files:
            data["files"] = {path: _redact_text(content, self) for path, content in self.files.items()}
        if self.request is not None:
            data["request"] = self.shown_request()
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_json_dict(), indent=2, sort_keys=False)

    def command_line(self) -> str:
        """The command as shown in logs and dry-run output (known secret values as ***); never run this text."""
        return shlex.join(self.shown_argv())

    def describe(self) -> str:
        """Human-readable dry-run text; a plan whose request is a list of Kubernetes manifests prints as YAML documents
        (notes and warnings as comments), which `kubectl apply -f -` takes as they are."""
        if self.request is not None and "manifests" in self.request:
            return self._manifests_yaml()
        lines = [f"Launcher: {self.launcher}", f"Working directory: {self.cwd}", "Command:", f"  {self.command_line()}"]
        if self.env:
            lines.append("Environment added for the launch:")
            lines += [f"  {k}={v}" for k, v in self.redacted_env().items()]
        for path, content in self.files.items():
            lines.append(f"File written before the launch: {path}")
            lines += [f"  {line}" for line in _redact_text(content, self).splitlines()]
        if self.request is not None:
            lines.append("Remote job request:")
            lines += [f"  {line}" for line in json.dumps(self.shown_request(), indent=2, sort_keys=True).splitlines()]
        lines += [f"Note: {n}" for n in self.notes]
        lines += [f"Warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def _manifests_yaml(self) -> str:
        import yaml

        comments = [f"# prefect-accelerate: {self.launcher} launch; every pod runs:", f"#   {self.command_line()}"]
        comments += [f"# Note: {n}" for n in self.notes] + [f"# Warning: {w}" for w in self.warnings]
        comments = [line.replace("\n", "\n# ") for line in comments]
        shown = self.shown_request() or {}
        return "\n".join(comments) + "\n" + yaml.safe_dump_all(shown["manifests"], sort_keys=False, explicit_start=True,
                                                                width=1000).rstrip("\n")


def _redact_strings(data: Any, redact: Redactor) -> Any:
    if isinstance(data, str):
        return redact(data)
    if isinstance(data, dict):
        return {key: _redact_strings(value, redact) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [_redact_strings(value, redact) for value in data]
    return data


def _redact_text(text: str, plan: LaunchPlan) -> str:
    out = []
    for line in text.splitlines(keepends=True):
        name = line.split("=", 1)[0]
        out.append(f"{name}={REDACTED}\n" if "=" in line and plan.is_secret(name) else line)
    return "".join(out)
