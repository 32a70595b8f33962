"""Where Accelerate keeps its default config, resolved when a command runs (not at import).

Accelerate computes the path once, at import time, and its "legacy JSON" default is the YAML path
again, so an old `default_config.json` is never found (reference §3.1, §10.3). Here the environment is
read on every call and the JSON file is found when no YAML file exists.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

DEFAULT_YAML_NAME = "default_config.yaml"
LEGACY_JSON_NAME = "default_config.json"


def hf_cache_home(environ: Mapping[str, str] | None = None) -> Path:
    """HF_HOME, else $XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface."""
    env = os.environ if environ is None else environ
    if env.get("HF_HOME"):
        return Path(os.path.expanduser(env["HF_HOME"]))
    cache = env.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(os.path.expanduser(os.path.join(cache, "huggingface")))


def accelerate_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    return hf_cache_home(environ) / "accelerate"


def default_config_path(environ: Mapping[str, str] | None = None) -> Path:
    """The path new default configs are written to: <cache>/accelerate/default_config.yaml."""
    return accelerate_cache_dir(environ) / DEFAULT_YAML_NAME


def legacy_json_config_path(environ: Mapping[str, str] | None = None) -> Path:
    return accelerate_cache_dir(environ) / LEGACY_JSON_NAME


ConfigSource = Literal["passed", "default", "legacy-default"]


class ConfigLocation(BaseModel):
    """A config file and how it was chosen (shown to the user, reference §10.1)."""

    model_config = ConfigDict(frozen=True)

    path: Path
    source: ConfigSource

    def __init__(self, path: Path | str, source: ConfigSource = "passed", **data) -> None:
        super().__init__(path=Path(path), source=source, **data)

    def describe(self) -> str:
        if self.source == "passed":
            return f"Using the config file {self.path}"
        if self.source == "legacy-default":
            return f"Using the legacy default config file {self.path} (no default_config.yaml was found)"
        return f"Using the default config file {self.path}"


def find_default_config(environ: Mapping[str, str] | None = None) -> ConfigLocation | None:
    """The default config that exists now: the YAML one, else a legacy JSON one, else None."""
    yaml_path = default_config_path(environ)
    if yaml_path.is_file():
        return ConfigLocation(yaml_path, "default")
    json_path = legacy_json_config_path(environ)
    if json_path.is_file():
        return ConfigLocation(json_path, "legacy-default")
    return None


def searched_locations(environ: Mapping[str, str] | None = None) -> list[Path]:
    return [default_config_path(environ), legacy_json_config_path(environ)]


def config_missing(config_file: str | os.PathLike[str] | None) -> bool:
    """True when `config_file` (or, for None, any default config) does not exist yet."""
    if config_file:
        return not Path(config_file).expanduser().exists()
    return find_default_config() is None
