"""deployments/prefect.yaml as data: what `prefect deploy --all` will register, checked without a server."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SPEC = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
#: the Kubernetes deployment has a file of its own: `prefect deploy --all` refuses a deployment whose pool does not exist
K8S_SPEC = yaml.safe_load((REPO / "deployments" / "kubernetes" / "prefect.yaml").read_text())
DEPLOYMENTS = {d["name"]: d for d in SPEC["deployments"] + K8S_SPEC["deployments"]}


def test_deploy_all_from_the_root_needs_only_the_process_pool():
    """`prefect deploy --all` stops at the first deployment whose work pool does not exist: the root file must
    name only the `process` pool a user creates first (deployments/README.md)."""
    assert {d["work_pool"]["name"] for d in SPEC["deployments"]} == {"accelerate"}
    assert {d["work_pool"]["name"] for d in K8S_SPEC["deployments"]} == {"accelerate-kubernetes"}


def test_every_deployment_is_on_the_process_pool_and_names_an_existing_flow():
    assert set(DEPLOYMENTS) == {"nightly", "on-demand", "slurm", "kubernetes", "per-node", "cluster"}
    for deployment in DEPLOYMENTS.values():
        # the Kubernetes deployment's flow run is itself a pod: it needs a `kubernetes` work pool
        assert deployment["work_pool"]["name"] == ("accelerate-kubernetes" if deployment["name"] == "kubernetes" else "accelerate")
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
    # but a Kubernetes flow run starts in a pod: the project is where the image put it
    assert not [d["name"] for d in SPEC["deployments"] if "pull" in d]
    assert [d["name"] for d in K8S_SPEC["deployments"]] == ["kubernetes"] and "pull" not in K8S_SPEC
    step = DEPLOYMENTS["kubernetes"]["pull"][0]["prefect.deployments.steps.set_working_directory"]
    assert step["directory"] == "/opt/prefect/prefect-accelerate"
    assert "WORKDIR /opt/prefect/prefect-accelerate" in (REPO / "deployments" / "kubernetes" / "Dockerfile").read_text()


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
        ("kubernetes", "prefect_accelerate.pipeline.models:PipelineRequest"),
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


def test_the_kubernetes_work_pools_template_renders_a_valid_job_that_hands_its_image_and_namespace_on():
    """Prefect's own templating fills the base job template as a worker does; the flow run's Job validates strictly."""
    import json

    import kubernetes_validate
    from prefect.utilities.templating import apply_values, find_placeholders

    template = json.loads((REPO / "deployments" / "kubernetes" / "base-job-template.json").read_text())
    variables = template["variables"]["properties"]
    assert {p.name for p in find_placeholders(template["job_configuration"])} <= set(variables)
    values = {name: spec["default"] for name, spec in variables.items() if "default" in spec}
    values |= {"image": "ghcr.io/acme/prefect-accelerate:1", "namespace": "ml", "name": "launch-training-abc12",
               "labels": {"prefect.io/flow-run-id": "0f1e"}, "command": "prefect flow-run execute", "env": {}}
    manifest = apply_values(template["job_configuration"], values)["job_manifest"]
    manifest["spec"]["template"]["spec"]["containers"][0]["args"] = ["prefect", "flow-run", "execute"]  # the worker splits it
    kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in manifest["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env == {"PREFECT_ACCELERATE_KUBERNETES_IMAGE": "ghcr.io/acme/prefect-accelerate:1", "PREFECT_ACCELERATE_KUBERNETES_NAMESPACE": "ml",
                   # the downward API: the training Job names this pod as its owner
                   "PREFECT_ACCELERATE_OWNER_POD": {"fieldRef": {"fieldPath": "metadata.name"}},
                   "PREFECT_ACCELERATE_OWNER_POD_UID": {"fieldRef": {"fieldPath": "metadata.uid"}}}
    assert manifest["spec"]["template"]["spec"]["serviceAccountName"] == "prefect-accelerate-launcher"


def test_the_launchers_role_allows_exactly_what_the_kubernetes_job_handle_calls():
    import kubernetes_validate

    documents = list(yaml.safe_load_all((REPO / "deployments" / "kubernetes" / "rbac.yaml").read_text()))
    for document in documents:
        kubernetes_validate.validate(document, kubernetes_validate.latest_version(), strict=True)
    role = next(d for d in documents if d["kind"] == "Role")
    allowed = {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"] for resource in rule["resources"] for verb in rule["verbs"]}
    needed = {("batch", "jobs", "create"), ("batch", "jobs", "get"), ("batch", "jobs", "delete"), ("", "services", "create"),
              ("", "services", "delete"), ("", "pods", "list"), ("", "pods/log", "get")}
    assert needed <= allowed
