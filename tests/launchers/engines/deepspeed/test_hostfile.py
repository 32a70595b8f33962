"""DeepSpeed hostfiles and resource filters: errors that name the line or the filter part, DeepSpeed's selection rules."""

from __future__ import annotations

import pytest

from prefect_accelerate.errors import ConfigError
from prefect_accelerate.launchers.engines.deepspeed.hostfile import parse_hostfile, read_hostfile, select_resources


def test_hostfile_errors_name_the_line():
    with pytest.raises(ConfigError, match=r"hf, line 3: 'node3 slots:2' is not a `HOST slots=N` entry"):
        parse_hostfile("# cluster\nnode1 slots=2\nnode3 slots:2\n", "hf")
    with pytest.raises(ConfigError, match=r"line 4: host node1 is listed again \(first on line 1\)"):
        parse_hostfile("node1 slots=2\nnode2 slots=2\n\nnode1 slots=4\n", "hf")
    with pytest.raises(ConfigError, match="line 2: node2 has slots=0"):
        parse_hostfile("node1 slots=2\nnode2 slots=0\n", "hf")
    with pytest.raises(ConfigError, match="lists no hosts"):
        parse_hostfile("# only a comment\n\n", "hf")


def test_hostfile_accepts_comments_blank_lines_and_trailing_mpi_options():
    hostfile = parse_hostfile("# head\n\nnode1 slots=8 max_slots=8\n  node2   slots=4  \n", "hf")
    assert [(h.name, h.slots, h.line) for h in hostfile.hosts] == [("node1", 8, 3), ("node2", 4, 4)]


def test_filters_select_what_deepspeed_selects():
    hostfile = parse_hostfile("a slots=4\nb slots=4\nc slots=2\n", "hf")
    assert select_resources(hostfile, include="b:1,3@a") == {"a": [0, 1, 2, 3], "b": [1, 3]}
    assert select_resources(hostfile, exclude="b@c:1") == {"a": [0, 1, 2, 3], "c": [0]}
    assert select_resources(hostfile, per_node=2) == {"a": [0, 1], "b": [0, 1], "c": [0, 1]}
    assert select_resources(hostfile, per_node=6) == {"a": list(range(6)), "b": list(range(6)), "c": list(range(6))}


def test_filters_that_are_wrong_or_select_nothing_are_refused():
    hostfile = parse_hostfile("a slots=2\nb slots=2\n", "hf")
    with pytest.raises(ConfigError, match="names host zz, which is not in the hostfile hf"):
        select_resources(hostfile, include="a@zz")
    with pytest.raises(ConfigError, match="asks for slot 2 on b, which has slots 0 to 1 in hf \\(line 2\\)"):
        select_resources(hostfile, include="b:2")
    with pytest.raises(ConfigError, match="'x' in 'a:x' is not a slot number"):
        select_resources(hostfile, exclude="a:x")
    with pytest.raises(ConfigError, match="exclusion filter 'a@b:0,1' leaves no host of hf"):
        select_resources(hostfile, exclude="a@b:0,1")


def test_reading_a_missing_hostfile_says_deepspeed_would_fall_back_silently(tmp_path):
    with pytest.raises(ConfigError, match="hosts.txt does not exist. DeepSpeed would quietly fall back to this machine alone"):
        read_hostfile(str(tmp_path / "hosts.txt"), shown_as="hosts.txt")
