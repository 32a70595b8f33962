"""One rule set for config values, applied when a file is written and when it is read (issue 27).

`config update` used to write num_machines 10^30 (launch refused it later: the range existed at launch time
only), and a main_process_ip of `'; rm -rf /'` passed update, env and the dry run.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefect_accelerate.config.model import MAX_MACHINES, MAX_PROCESSES_PER_MACHINE, ClusterConfig, address_problem
from prefect_accelerate.errors import ConfigError, UsageError

CLI = [sys.executable, "-m", "prefect_accelerate.cli.main"]
BASE = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "num_processes": 2}


def write(tmp_path, **fields) -> str:
    import yaml

    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({**BASE, **fields}))
    return str(path)


def run(*argv: str, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf")}
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("fields, field", [
    ({"num_machines": 10**30}, "num_machines"),
    ({"num_machines": 2, "main_process_ip": "'; rm -rf /"}, "main_process_ip"),
    ({"num_machines": 2, "machine_rank": MAX_MACHINES}, "machine_rank"),
    ({"num_processes": (MAX_PROCESSES_PER_MACHINE + 1) * 2, "num_machines": 2, "main_process_ip": "10.0.0.1"}, "num_processes"),
])
@pytest.mark.parametrize("command", ["config update", "env", "launch --dry-run"])
def test_a_value_out_of_range_is_refused_by_every_command_that_reads_or_writes_the_file(tmp_path, fields, field, command):
    path = write(tmp_path, **fields)
    before = open(path).read()
    extra = {"config update": ["--config_file", path], "env": ["--config_file", path, "--no_import_check"],
             "launch --dry-run": ["--config_file", path, "train.py"]}[command]
    done = run(*command.split(), *extra, tmp_path=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    message = done.stderr.strip()
    assert "Traceback" not in message and len(message.splitlines()) == 1  # one paragraph
    assert path in message and field in message and "Edit the file" in message
    assert open(path).read() == before  # nothing written


def test_a_flag_is_held_to_the_same_address_rule(tmp_path):
    done = run("launch", "--dry-run", "--cpu", "--num_machines", "2", "--main_process_ip", "'; rm -rf /", "train.py", tmp_path=tmp_path)
    assert done.returncode == 2 and "--main_process_ip" in done.stderr and "host name" in done.stderr


_label = st.from_regex(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,20}[A-Za-z0-9_])?", fullmatch=True)


@settings(max_examples=200, deadline=None)
@given(st.one_of(
    st.lists(_label, min_size=1, max_size=5).map(".".join),
    st.ip_addresses().map(str),
    st.ip_addresses(v=6).map(lambda ip: f"[{ip}]"),
))
def test_every_host_name_and_ip_address_is_accepted(address):
    assert address_problem(address) is None
    assert ClusterConfig(**BASE, num_machines=2, main_process_ip=address).main_process_ip == address


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=40))
@example("0\n")  # found by CI: stripped before the check, accepted, then passed on with its newline
@example("node-0\n")  # a host label's `$` matched before the final newline
@example(" 10.0.0.1")
@example("10.0.0.1\t")
def test_anything_with_a_character_no_address_has_is_refused(text):
    def is_ip(value: str) -> bool:
        try:
            ipaddress.ip_address(value.strip("[]"))
            return True
        except ValueError:
            return False

    if any(ch in text for ch in " ;'\"$`|&/\\()<>*?!{}\n\t\r\f\v") and not is_ip(text):
        assert address_problem(text) is not None
        with pytest.raises(ValueError):
            ClusterConfig(**BASE, num_machines=2, main_process_ip=text)


def test_the_loader_and_the_flag_check_name_the_same_limits():
    from prefect_accelerate.config.io import parse_config
    from prefect_accelerate.launchers.options import check_ranges

    with pytest.raises(ConfigError, match="num_machines"):
        parse_config({**BASE, "num_machines": MAX_MACHINES + 1}, __import__("pathlib").Path("c.yaml"))
    with pytest.raises(UsageError, match=str(MAX_MACHINES)):
        check_ranges({"num_machines": MAX_MACHINES + 1}, frozenset({"num_machines"}))
    parse_config({**BASE, "num_machines": MAX_MACHINES, "main_process_ip": "node-0"}, __import__("pathlib").Path("c.yaml"))
