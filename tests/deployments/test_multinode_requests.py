"""Multi-node requests: per-machine queues, ranks and rendezvous, checked without a server."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from prefect_accelerate.flows.multinode import (
    MultinodeRequest,
    NodeLaunchRequest,
    multinode_launch,
    node_launch,
    node_options,
    node_queue_name,
    node_run_name,
)

FLAGS = {"cpu": True, "num_processes": 4, "mixed_precision": "no", "dynamo_backend": "no"}


def request(**changes) -> MultinodeRequest:
    return MultinodeRequest(**{"script": "train.py", "main_process_ip": "10.0.0.5", "launch_flags": FLAGS, **changes})


def test_each_machine_gets_its_own_queue_by_default_or_as_listed():
    assert [request().queue(r) for r in range(2)] == ["accelerate-node-0", "accelerate-node-1"]
    assert request(work_queue_prefix="gpu").queue(1) == node_queue_name(1, "gpu") == "gpu-node-1"
    assert request(work_queues=["a100-box", "h100-box"]).queue(1) == "h100-box"
    with pytest.raises(ValidationError, match="one per machine"):
        request(work_queues=["only-one"])


def test_topology_flags_are_fields_not_launch_flags():
    with pytest.raises(ValidationError, match="machine_rank"):
        request(launch_flags={**FLAGS, "machine_rank": 1})
    with pytest.raises(ValidationError, match="num_procesess"):
        request(launch_flags={"num_procesess": 4})


def test_a_machine_other_than_rank_0_needs_the_port():
    with pytest.raises(ValidationError, match="needs the main machine's port"):
        NodeLaunchRequest(script="train.py", num_machines=2, machine_rank=1, main_process_ip="10.0.0.5")
    with pytest.raises(ValidationError, match="not below num_machines"):
        NodeLaunchRequest(script="train.py", num_machines=2, machine_rank=2, main_process_ip="10.0.0.5", main_process_port=29500)


def test_every_machine_plans_its_rank_against_the_same_rendezvous(tmp_path):
    from prefect_accelerate.launchers import plan_launch

    parent = request(num_machines=2, main_process_port=29555)
    argvs = []
    for rank in range(2):
        node = parent.node_request(rank, 29555)
        assert (node.machine_rank, node.num_machines, node.script, node.launch_flags) == (rank, 2, "train.py", FLAGS)
        options = node_options(node, 29555).with_changes(run_dir=str(tmp_path / str(rank)))
        argvs.append(" ".join(plan_launch(options).argv))
    for rank, argv in enumerate(argvs):
        assert f"--nproc_per_node 2 --nnodes 2 --node_rank {rank} --rdzv_endpoint 10.0.0.5:29555" in argv


def test_run_names_say_which_machine():
    assert node_run_name(1, 2) == "node-launch-rank1-of-2"


def test_flow_parameters_are_typed_models_for_the_ui_form():
    from prefect.utilities.callables import parameter_schema

    node = parameter_schema(node_launch.fn).model_dump()
    parent = parameter_schema(multinode_launch.fn).model_dump()
    assert node["properties"]["request"]["$ref"].endswith("/NodeLaunchRequest")
    assert {"num_machines", "main_process_ip", "work_queues", "job_variables"} <= set(parent["definitions"]["MultinodeRequest"]["properties"])
