"""Packaging metadata (issue 17 item 14): the license is an SPDX string, not the table form setuptools drops."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is 3.11+")
def test_license_is_an_spdx_string_and_the_build_backend_supports_it():
    import tomllib

    data = tomllib.loads(PYPROJECT.read_text())
    assert data["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in data["build-system"]["requires"]
