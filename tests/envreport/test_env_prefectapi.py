"""PREFECT_API_URL found from the same places Prefect 3 reads, without importing Prefect."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefect_accelerate.envreport.prefectapi import EPHEMERAL, prefect_api

PROFILES = """\
active = "remote"

[profiles.ephemeral]
PREFECT_SERVER_EPHEMERAL_ENABLED = "true"

[profiles.remote]
PREFECT_API_URL = "http://10.0.0.5:4200/api"
"""


def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    env.update(extra)
    return env


def test_nothing_set_means_the_ephemeral_server(tmp_path):
    api = prefect_api(clean_env(tmp_path), tmp_path)
    assert api.url is None and api.describe() == EPHEMERAL


def test_the_environment_wins_over_every_file(tmp_path):
    (tmp_path / "prefect.toml").write_text('[api]\nurl = "http://file/api"\n')
    api = prefect_api(clean_env(tmp_path, PREFECT_API_URL="http://env/api"), tmp_path)
    assert api.url == "http://env/api" and "environment variable" in api.source


def test_the_active_profile_is_read_from_prefect_home(tmp_path):
    (tmp_path / "prefect-home").mkdir()
    (tmp_path / "prefect-home" / "profiles.toml").write_text(PROFILES)
    api = prefect_api(clean_env(tmp_path), tmp_path)
    assert api.url == "http://10.0.0.5:4200/api" and "profile 'remote'" in api.source


def test_prefect_profile_selects_another_profile(tmp_path):
    (tmp_path / "prefect-home").mkdir()
    (tmp_path / "prefect-home" / "profiles.toml").write_text(PROFILES)
    assert prefect_api(clean_env(tmp_path, PREFECT_PROFILE="ephemeral"), tmp_path).url is None


def test_dotenv_prefect_toml_and_pyproject_are_read_in_that_order(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.prefect.api]\nurl = "http://pyproject/api"\n')
    assert prefect_api(clean_env(tmp_path), tmp_path).url == "http://pyproject/api"
    (tmp_path / "prefect.toml").write_text('[api]\nurl = "http://prefect-toml/api"\n')
    assert prefect_api(clean_env(tmp_path), tmp_path).url == "http://prefect-toml/api"
    (tmp_path / ".env").write_text('# comment\nexport PREFECT_API_URL="http://dotenv/api"\n')
    assert prefect_api(clean_env(tmp_path), tmp_path).url == "http://dotenv/api"


def test_an_unreadable_profiles_file_is_ignored(tmp_path):
    (tmp_path / "prefect-home").mkdir()
    (tmp_path / "prefect-home" / "profiles.toml").write_text("active = [\n")
    assert prefect_api(clean_env(tmp_path), tmp_path).url is None


def test_prefect_itself_agrees(tmp_path):
    """Prefect's own settings, built in a child process for each case, give the same URL."""
    pytest.importorskip("prefect")
    cases = {}
    for name, files, extra in (
        ("nothing", {}, {}),
        ("profile", {"prefect-home/profiles.toml": PROFILES}, {}),
        ("profile-override", {"prefect-home/profiles.toml": PROFILES}, {"PREFECT_PROFILE": "ephemeral"}),
        ("toml", {"prefect.toml": '[api]\nurl = "http://prefect-toml/api"\n'}, {}),
        ("env", {"prefect.toml": '[api]\nurl = "http://prefect-toml/api"\n'}, {"PREFECT_API_URL": "http://env/api"}),
    ):
        folder = tmp_path / name
        for relative, text in files.items():
            (folder / relative).parent.mkdir(parents=True, exist_ok=True)
            (folder / relative).write_text(text)
        folder.mkdir(exist_ok=True)
        env = clean_env(folder, **extra)
        cases[name] = (str(folder), {k: v for k, v in env.items() if k.startswith("PREFECT_")})
    code = """
import json, os, sys
from prefect.settings.models.root import Settings
out = {}
base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
for name, (folder, env) in json.loads(sys.argv[1]).items():
    os.chdir(folder)
    os.environ.clear(); os.environ.update(base); os.environ.update(env)
    out[name] = Settings().api.url
print(json.dumps(out))
"""
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True, env=clean_env(tmp_path), check=True
    )
    theirs = json.loads(result.stdout.strip().splitlines()[-1])
    ours = {name: prefect_api({**clean_env(Path(folder)), **env}, folder).url for name, (folder, env) in cases.items()}
    assert ours == theirs
    assert theirs["profile"] == "http://10.0.0.5:4200/api" and theirs["nothing"] is None


def test_a_url_a_tracked_command_took_from_the_local_servers_record_is_not_called_the_users_variable(tmp_path):
    """A tracked command sets PREFECT_API_URL itself once it found the local server; `check` then reports that
    server, not "the environment variable", while a variable the user set to another address still reads as theirs."""
    from prefect_accelerate import localserver

    home = tmp_path / "prefect-home"
    record = localserver.ServerRecord(url="http://127.0.0.1:45123/api", port=45123, keeper_pid=os.getpid(), state="ready")
    localserver._write_record(home, record)
    api = prefect_api(clean_env(tmp_path, PREFECT_API_URL=record.url), tmp_path)
    assert api.url == record.url and "environment variable" not in api.source
    assert f"local Prefect server of PREFECT_HOME={home}" in api.describe()
    other = prefect_api(clean_env(tmp_path, PREFECT_API_URL="http://127.0.0.1:4200/api"), tmp_path)
    assert other.source == "the environment variable PREFECT_API_URL"


def test_the_local_server_record_is_read_where_localserver_writes_it(tmp_path):
    from prefect_accelerate import localserver

    home = tmp_path / "prefect-home"
    assert localserver.record_path(home) == home / "prefect-accelerate" / "server.json"
