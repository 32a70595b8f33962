"""Which Prefect API a tracked command would talk to, found without importing Prefect.

Importing prefect costs seconds, and `env` must stay fast and work without a server. Prefect 3 reads
its settings from, in priority order: the environment, a `.env` file in the working directory,
`prefect.toml`, `pyproject.toml` ([tool.prefect]), then the active profile of its profiles file. We
read the same places for the one setting `env` reports, PREFECT_API_URL. Unset everywhere means the
long-lived local server of PREFECT_HOME (localserver.py; DESIGN.md §4, "Prefect").
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:  # Python 3.11+
    import tomllib as _toml
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    try:
        import tomli as _toml  # type: ignore[no-redef]
    except ModuleNotFoundError:
        _toml = None  # type: ignore[assignment]

API_URL_SETTING = "PREFECT_API_URL"
EPHEMERAL = "none set: the local Prefect server of PREFECT_HOME (prefect-accelerate server status)"


@dataclass(frozen=True)
class PrefectApi:
    """The API URL in use (None: the embedded ephemeral server) and where that came from."""

    url: str | None
    source: str

    def describe(self) -> str:
        return f"{self.url} (from {self.source})" if self.url else EPHEMERAL


def _read_toml(path: Path) -> dict[str, Any]:
    if _toml is None or not path.is_file():
        return {}
    try:
        with path.open("rb") as handle:
            return _toml.load(handle)
    except (OSError, ValueError):  # Prefect warns and ignores an unreadable file; so do we
        return {}


def _dig(data: Mapping[str, Any], *keys: str) -> Any:
    node: Any = data
    for key in keys:
        if not isinstance(node, Mapping):
            return None
        node = node.get(key)
    return node


def _read_dotenv(path: Path) -> dict[str, str]:
    """The KEY=VALUE lines of a .env file (comments, `export` and quotes as python-dotenv reads them)."""
    values: dict[str, str] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return values
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.removeprefix("export ").partition("=")
        value = value.strip()
        if value[:1] in ("'", '"') and value.endswith(value[:1]) and len(value) > 1:
            value = value[1:-1]
        elif " #" in value:
            value = value.split(" #", 1)[0].rstrip()
        values[key.strip()] = value
    return values


def profiles_path(environ: Mapping[str, str], cwd: Path, dotenv: Mapping[str, str]) -> Path:
    """Where Prefect looks for profiles.toml, in its own order."""
    for candidate in (
        environ.get("PREFECT_PROFILES_PATH"),
        dotenv.get("PREFECT_PROFILES_PATH"),
        _dig(_read_toml(cwd / "prefect.toml"), "profiles_path"),
        _dig(_read_toml(cwd / "pyproject.toml"), "tool", "prefect", "profiles_path"),
    ):
        if candidate:
            return Path(str(candidate)).expanduser()
    home = environ.get("PREFECT_HOME")
    return Path(home).expanduser() / "profiles.toml" if home else Path("~/.prefect/profiles.toml").expanduser()


def _environment_source(env: Mapping[str, str], url: str) -> str:
    """Where a PREFECT_API_URL in the environment came from. A tracked command that found (or started) the local
    server of PREFECT_HOME sets the variable itself, for Prefect and its child processes: then that server is the
    source, not the user's environment."""
    home = Path(env.get("PREFECT_HOME") or "~/.prefect").expanduser()
    # the record localserver writes (localserver.record_path), read here as plain JSON: localserver itself reads
    # this module, and nothing more than its address is needed
    try:
        recorded = json.loads((home / "prefect-accelerate" / "server.json").read_text()).get("url")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if url and recorded == url:
        return f"the local Prefect server of PREFECT_HOME={home}, see prefect-accelerate server status"
    return f"the environment variable {API_URL_SETTING}"


def prefect_api(environ: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None) -> PrefectApi:
    """Find PREFECT_API_URL the way Prefect 3 settings do, reading files only (no prefect import).

    Args:
        environ: the environment to read (os.environ when None).
        cwd: the working directory whose .env, prefect.toml and pyproject.toml count (the current one when None).

    Returns:
        The URL and its source, or url None when no source sets it (the ephemeral server).
    """
    env = os.environ if environ is None else environ
    here = Path.cwd() if cwd is None else Path(cwd)
    if API_URL_SETTING in env:  # set, even to "", wins over every file
        return PrefectApi(env[API_URL_SETTING] or None, _environment_source(env, env[API_URL_SETTING]))
    dotenv = _read_dotenv(here / ".env")
    if API_URL_SETTING in dotenv:
        return PrefectApi(dotenv[API_URL_SETTING] or None, f"{here / '.env'}")
    url = _dig(_read_toml(here / "prefect.toml"), "api", "url")
    if url:
        return PrefectApi(str(url), f"{here / 'prefect.toml'}")
    url = _dig(_read_toml(here / "pyproject.toml"), "tool", "prefect", "api", "url")
    if url:
        return PrefectApi(str(url), f"{here / 'pyproject.toml'} [tool.prefect.api]")
    path = profiles_path(env, here, dotenv)
    data = _read_toml(path)
    active = env.get("PREFECT_PROFILE") or data.get("active")
    profile = _dig(data, "profiles", str(active)) if active else None
    url = _dig(profile, API_URL_SETTING) if isinstance(profile, Mapping) else None
    if url:
        return PrefectApi(str(url), f"profile {active!r} in {path}")
    return PrefectApi(None, "no setting (Prefect's default)")
