"""A real two-node Slurm for the Slurm engine's tests (tests/helpers/slurm_cluster.py), once per session.

Skipped, with the reason, only where Slurm is missing and apt cannot install it (not root, no apt).
"""

from __future__ import annotations

import os

import pytest

from helpers.slurm_cluster import ClusterUnavailable, start_cluster


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    try:
        cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    except ClusterUnavailable as error:
        if os.environ.get("PREFECT_ACCELERATE_TESTS_STRICT") == "1" and os.geteuid() == 0:
            raise
        pytest.skip(f"no real Slurm here: {error}")
    saved = os.environ.get("SLURM_CONF")
    os.environ.update(cluster.env)  # every sbatch/scontrol the tests and the launcher run finds this cluster
    try:
        yield cluster
    finally:
        cluster.stop()
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved
