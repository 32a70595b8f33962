"""deployments/prefect.yaml as data: what `prefect deploy --all` will register, checked without a server."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SPEC = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
DEPLOYMENTS = {d["name"]: d for d in SPEC["deployments"]}


def test_every_deployment_is_on_the_process_pool_and_names_an_existing_flow():
    assert set(DEPLOYMENTS) == {"nightly", "on-demand", "slurm", "per-node", "cluster"}
    for deployment in DEPLOYMENTS.values():
        assert deployment["work_pool"]["name"] == "accelerate"
        path, function = deployment["entrypoint"].split(":")
        source = REPO / path  # relative to the repository root, where `prefect deploy` runs
        assert source.is_file(), deployment["entrypoint"]
        functions = {node.name for node in ast.walk(ast.parse(source.read_text())) if isinstance(node, ast.FunctionDef)}
        assert function in functions, deployment["entrypoint"]


def test_the_repository_roots_prefect_yaml_is_this_file_so_plain_deploy_finds_it():
    root = REPO / "prefect.yaml"
    assert root.is_symlink() and root.resolve() == (REPO / "deployments" / "prefect.yaml").resolve()


def test_no_pull_section_so_deploy_records_the_checkout_it_runs_in():
    # prefect deploy then stores set_working_directory: <cwd>; no git remote or image is involved
    assert "pull" not in SPEC and SPEC["build"] is None and SPEC["push"] is None


def test_nightly_validation_is_scheduled_one_at_a_time_over_the_configs_folder():
    from prefect_accelerate.pipeline.models import ValidationRequest

    nightly = DEPLOYMENTS["nightly"]
    assert [s["cron"] for s in nightly["schedules"]] == ["0 2 * * *"]
    assert nightly["concurrency_limit"] == 1
    request = ValidationRequest.model_validate(nightly["parameters"]["request"])
    assert all((REPO / c).exists() for c in request.configs)


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("on-demand", "prefect_accelerate.pipeline.models:PipelineRequest"),
        ("slurm", "prefect_accelerate.pipeline.models:PipelineRequest"),
        ("cluster", "prefect_accelerate.flows.multinode:MultinodeRequest"),
    ],
)
def test_deployment_parameters_are_valid_requests(name, model):
    import importlib

    module, cls = model.split(":")
    request = getattr(importlib.import_module(module), cls).model_validate(DEPLOYMENTS[name]["parameters"]["request"])
    assert (REPO / request.script).is_file()


def test_example_config_plans_two_cpu_processes_through_torchrun(tmp_path):
    from prefect_accelerate.launchers import plan_launch
    from prefect_accelerate.launchers.options import build_launch_options

    config = REPO / "deployments" / "configs" / "cpu-2proc.yaml"
    options = build_launch_options(str(REPO / "examples" / "ddp_allreduce.py"), config_file=config, run_dir=str(tmp_path))
    plan = plan_launch(options)
    assert plan.launcher == "torchrun" and plan.num_processes == 2
    assert plan.env["ACCELERATE_USE_CPU"] == "True"
