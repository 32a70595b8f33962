"""SageMaker plans: the job request built from a SageMaker config, checked against Accelerate 1.16's own
`prepare_sagemager_args_inputs` where they should agree, and pinned where we differ on purpose. No network:
the guard refuses anything that is not loopback (image URIs are resolved from the SDK's bundled table).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from helpers.golden import assert_golden

from prefect_accelerate.errors import ConfigError, UsageError
from prefect_accelerate.launchers.engines.sagemaker import credentials as aws_credentials
from prefect_accelerate.launchers.engines.sagemaker import plan as sm_launcher
from prefect_accelerate.launchers.host import StaticHost
from prefect_accelerate.launchers.options import build_launch_options
from prefect_accelerate.launchers.engines.sagemaker.hparams import script_hyperparameters

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fakes"))
from netguard import guarded  # noqa: E402

HOST = StaticHost(python_path="PYTHON")
IMAGE = "763104351884.dkr.ecr.us-east-1.amazonaws.com/huggingface-pytorch-training:2.8.0-transformers4.56.2-gpu-py312-cu129-ubuntu22.04"
CONFIG = f"""\
compute_environment: AMAZON_SAGEMAKER
distributed_type: DATA_PARALLEL
ec2_instance_type: ml.p3.16xlarge
iam_role_name: SMRole
mixed_precision: bf16
num_machines: 2
region: us-east-1
image_uri: {IMAGE}
sagemaker_inputs_file: inputs.tsv
sagemaker_metrics_file: metrics.tsv
base_job_name: my-sweep
"""
INPUTS = "channel_name\tdata_location\ntrain\ts3://data/train\ntest\ts3://data/test\n"
METRICS = "metric_name\tmetric_regex\nloss\tloss: ([0-9.]+)\naccuracy\taccuracy = ([0-9.]+)\n"


@pytest.fixture(autouse=True)
def project(tmp_path, monkeypatch, hf_home):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(aws_credentials.AWS_BLOCK_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))  # mlflow (a SageMaker SDK dependency) writes there
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("print('train')\n")
    (tmp_path / "inputs.tsv").write_text(INPUTS)
    (tmp_path / "metrics.tsv").write_text(METRICS)
    with guarded() as blocked:
        yield tmp_path
        assert not blocked, blocked


def config_file(tmp_path, extra: str = "", text: str = CONFIG) -> str:
    path = tmp_path / "sm.yaml"
    path.write_text(text + extra)
    return str(path)


def make_plan(tmp_path, args=("--lr", "3e-4", "--epochs", "3"), *, extra="", text=CONFIG, **flags):
    options = build_launch_options("src/train.py", list(args), config_file=config_file(tmp_path, extra, text), host=HOST, environ={}, **flags)
    run_dir = str(tmp_path / "runs" / "20260101-000000-launch-abc123")
    return sm_launcher.plan(options, HOST, cwd=str(tmp_path), run_dir=run_dir)


# ------------------------------------------------------------------------------------------------
# Hyperparameters


def accelerate_hyperparameters(args: list[str]):
    from accelerate.utils.launch import _convert_nargs_to_dict

    return _convert_nargs_to_dict(args)


@pytest.mark.parametrize("args", [
    ["--lr", "3e-4", "--epochs", "3", "--scale", "1e3", "--ratio", "50.5", "--name", "bert-base"],
    ["--use_fp16", "True", "--resume", "False", "--text", "true"],
    ["--learning-rate", "5e-5", "-k", "2", "--model_name_or_path", "gpt2"],
    ["--big", "1e400", "--nan", "nan", "--under", "1_000"],
])
def test_script_arguments_become_hyperparameters_typed_as_accelerate_types_them(args):
    ours, theirs = script_hyperparameters(args), accelerate_hyperparameters(args)
    assert list(ours) == list(theirs)
    for key in ours:
        if isinstance(theirs[key], float) and math.isnan(theirs[key]):
            assert math.isnan(ours[key])
        else:
            assert ours[key] == theirs[key] and type(ours[key]) is type(theirs[key]), key


@pytest.mark.parametrize("args", [["--fp16"], ["--fp16", "--lr", "1"], ["--lr", "1", "--fp16"]])
def test_a_flag_without_a_value_is_a_clear_usage_error_as_accelerate_refuses_it(args):
    with pytest.raises(UsageError, match="has no value.*store_true"):
        script_hyperparameters(args)
    with pytest.raises(ValueError, match="store_true"):
        accelerate_hyperparameters(args)


def test_negative_numbers_are_values_where_accelerate_takes_them_for_flags():
    assert script_hyperparameters(["--shift", "-1", "--eps", "-1e-8"]) == {"shift": -1, "eps": -1e-08}
    with pytest.raises(ValueError):
        accelerate_hyperparameters(["--shift", "-1"])


def test_a_repeated_flag_keeps_its_last_value_where_accelerate_crashes():
    import argparse

    assert script_hyperparameters(["--lr", "1", "--lr", "2"]) == {"lr": 2}
    with pytest.raises(argparse.ArgumentError, match="conflicting option string"):
        accelerate_hyperparameters(["--lr", "1", "--lr", "2"])


def test_name_equals_value_is_accepted():
    assert script_hyperparameters(["--lr=3e-4", "--name=x=y"]) == {"lr": 0.0003, "name": "x=y"}


def test_a_positional_script_argument_is_a_usage_error_that_says_why():
    with pytest.raises(UsageError, match="'data.csv' is not part of a `--name value` pair"):
        script_hyperparameters(["data.csv", "--lr", "1"])


# ------------------------------------------------------------------------------------------------
# The job request


def accelerate_estimator_arguments(config: Path, argv: list[str], monkeypatch):
    """Accelerate's estimator arguments for this config. Its `_validate_launch_command` crashes on every SageMaker
    config in 1.16.0 (it reads `parallelism_config`, which SageMakerConfig lacks), so the namespace is completed by
    hand with what that function would have set: the config's mixed precision and dynamo backend `no`."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils.launch import prepare_sagemager_args_inputs

    monkeypatch.setenv("AWS_PROFILE", "unused")  # it writes AWS_* into os.environ; monkeypatch restores them
    monkeypatch.setenv("AWS_DEFAULT_REGION", "unused")
    defaults = load_config_from_file(str(config))
    args = launch_command_parser().parse_args(["--aws_access_key_id", "k", "--aws_secret_access_key", "s", "src/train.py", *argv])
    args.mixed_precision, args.dynamo_backend = defaults.mixed_precision, "no"
    return prepare_sagemager_args_inputs(defaults, args)


def test_accelerate_1_16_cannot_launch_any_sagemaker_config_where_we_can(project):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", config_file(project), "src/train.py"])
    with pytest.raises(AttributeError, match="parallelism_config"):
        _validate_launch_command(args)
    assert make_plan(project).launcher == "sagemaker"


def test_the_request_matches_accelerates_estimator_arguments(project, monkeypatch):
    argv = ["--lr", "3e-4", "--epochs", "3", "--flag", "True"]
    request = make_plan(project, argv).request
    theirs, inputs = accelerate_estimator_arguments(project / "sm.yaml", argv, monkeypatch)
    assert request["hyperparameters"] == theirs["hyperparameters"]
    assert request["environment"] == theirs["environment"]
    assert request["metric_definitions"] == theirs["metric_definitions"]
    assert request["inputs"] == inputs
    assert (request["instance_count"], request["instance_type"], request["role"]) == (theirs["instance_count"], theirs["instance_type"], theirs["role"])
    assert (request["entry_script"], request["source_dir"]) == (theirs["entry_point"], str((project / theirs["source_dir"]).resolve()))
    assert request["image_uri"] == theirs["image_uri"]
    assert request["distribution"] == {"torchrun": {"process_count_per_node": None}}  # SDK 3's form of theirs:
    assert theirs["distribution"] == {"smdistributed": {"dataparallel": {"enabled": True}}}
    assert request["base_job_name"].startswith("my-sweep-") and theirs["base_job_name"] == "my-sweep"


def test_the_plan_matches_the_golden_file(project):
    plan = make_plan(project, extra="additional_args:\n  max_run: 7200\n  volume_size: 200\n  output_path: s3://bucket/out\n")
    data = json.loads(plan.to_json().replace(str(project), "CWD"))
    data["notes"], data["warnings"] = [n.replace(str(project), "CWD") for n in plan.notes], list(plan.warnings)
    assert_golden("sagemaker/plan-data-parallel", data)


def test_the_container_command_shows_the_hyperparameters_as_the_script_will_receive_them(project):
    plan = make_plan(project, ["--lr", "3e-4", "--flag", "True", "--name", "x"])
    assert plan.argv == ("python", "train.py", "--lr", "0.0003", "--flag", "true", "--name", "x")


def test_every_launch_gets_its_own_valid_base_job_name():
    first = sm_launcher.unique_base_job_name("accelerate_sagemaker-1", "/runs/20260101-000000-launch-a1b2c3")
    second = sm_launcher.unique_base_job_name("accelerate_sagemaker-1", "/runs/20260101-000000-launch-d4e5f6")
    assert first != second and first.startswith("accelerate-sagemaker-1-")
    long = sm_launcher.unique_base_job_name("x" * 80 + "!!", "/runs/a")
    assert len(long) <= sm_launcher.MAX_BASE_JOB_NAME and set(long) <= set("x-0123456789abcdef")


def test_additional_args_are_merged_in_sdk3_terms(project):
    plan = make_plan(project, extra="""additional_args:
  environment: {EXTRA: "1"}
  hyperparameters: {seed: 7}
  max_run: 7200
  max_wait: 9000
  use_spot_instances: true
  volume_size: 200
  checkpoint_s3_uri: s3://bucket/ckpt
  subnets: [subnet-1]
  security_group_ids: [sg-1]
  tags: {team: ml}
  code_location: s3://bucket/code
  distribution: {mpi: {enabled: true, processes_per_host: 8, custom_mpi_options: "-x NCCL_DEBUG=INFO"}}
""")
    request = plan.request
    assert request["environment"]["EXTRA"] == "1" and request["environment"]["ACCELERATE_USE_SAGEMAKER"] == "true"
    assert request["hyperparameters"] == {"lr": 0.0003, "epochs": 3, "seed": 7}
    assert request["stopping_condition"] == {"max_runtime_in_seconds": 7200, "max_wait_time_in_seconds": 9000}
    assert request["compute"] == {"enable_managed_spot_training": True, "volume_size_in_gb": 200}
    assert request["networking"] == {"subnets": ["subnet-1"], "security_group_ids": ["sg-1"]}
    assert request["tags"] == [{"Key": "team", "Value": "ml"}] and request["checkpoint_s3_uri"] == "s3://bucket/ckpt"
    assert request["distribution"] == {"mpi": {"process_count_per_node": 8, "mpi_additional_options": ["-x", "NCCL_DEBUG=INFO"]}}


def test_unknown_additional_args_are_refused_with_a_suggestion(project):
    with pytest.raises(ConfigError, match="'max_runn'.*Did you mean `max_run`"):
        make_plan(project, extra="additional_args:\n  max_runn: 10\n")


def test_model_parallel_warns_that_it_gets_no_distribution(project):
    plan = make_plan(project, text=CONFIG.replace("DATA_PARALLEL", "MODEL_PARALLEL"))
    assert plan.request["distribution"] is None and any("MODEL_PARALLEL" in w for w in plan.warnings)


def test_the_configs_dynamo_settings_reach_the_job_where_accelerate_ignores_them(project):
    plan = make_plan(project, extra="dynamo_config:\n  dynamo_backend: INDUCTOR\n  dynamo_mode: max-autotune\n")
    assert plan.request["environment"]["ACCELERATE_DYNAMO_BACKEND"] == "INDUCTOR"
    assert plan.request["environment"]["ACCELERATE_DYNAMO_MODE"] == "max-autotune"
    flagged = make_plan(project, extra="dynamo_config:\n  dynamo_backend: INDUCTOR\n", dynamo_backend="no")
    assert flagged.request["environment"]["ACCELERATE_DYNAMO_BACKEND"] == "NO"  # a flag still wins


def test_the_configs_debug_setting_reaches_the_job_where_accelerate_ignores_it(project):
    plan = make_plan(project, extra="debug: true\n")
    assert plan.request["environment"]["ACCELERATE_DEBUG_MODE"] == "true"
    assert "ACCELERATE_DEBUG_MODE" not in make_plan(project).request["environment"]


def test_fp8_variables_do_not_depend_on_the_launching_machine(project):
    host = StaticHost(python_path="PYTHON", fp8=False)
    options = build_launch_options("src/train.py", [], config_file=config_file(project), host=host, environ={}, mixed_precision="fp8")
    plan = sm_launcher.plan(options, host, cwd=str(project), run_dir=str(project / "r"))
    assert plan.request["environment"]["ACCELERATE_MIXED_PRECISION"] == "fp8"
    assert plan.request["environment"]["ACCELERATE_FP8_FORMAT"] == "HYBRID"


@pytest.mark.parametrize(("argv", "flags", "message"), [
    (["-m", "pkg.train"], {"module": True}, "cannot be used with --module"),
    ([], {"no_python": True}, "cannot be used with --module or --no_python"),
])
def test_module_and_no_python_are_refused(project, argv, flags, message):
    with pytest.raises(UsageError, match=message):
        make_plan(project, (), **flags)


def test_a_script_that_is_not_python_is_refused(project):
    options = build_launch_options("run.sh", [], config_file=config_file(project), host=HOST, environ={})
    with pytest.raises(UsageError, match="not a .py file"):
        sm_launcher.plan(options, HOST, cwd=str(project), run_dir=None)


def test_a_malformed_tsv_line_names_the_file_and_line(project):
    (project / "inputs.tsv").write_text("channel\tlocation\ntrain s3://no-tab\n")
    with pytest.raises(ConfigError, match=r"inputs.tsv, line 2: expected two tab-separated columns"):
        make_plan(project)


# ------------------------------------------------------------------------------------------------
# Images


def no_image(text: str = CONFIG) -> str:
    return "".join(line + "\n" for line in text.splitlines() if not line.startswith("image_uri"))


def test_the_image_follows_the_configs_versions_when_it_sets_them(project):
    plan = make_plan(project, text=no_image() + "pytorch_version: 2.8.0\ntransformers_version: 4.56.2\npy_version: py312\n")
    assert plan.request["image_uri"] == IMAGE


def test_without_versions_the_image_matches_the_installed_torch_or_the_newest_older_one(project, monkeypatch):
    monkeypatch.setattr(sm_launcher, "_installed", lambda name: {"torch": "2.8.1", "transformers": None}.get(name))
    plan = make_plan(project, text=no_image() + "pytorch_version: 1.10.2\ntransformers_version: 4.17.0\npy_version: py38\n")
    assert plan.request["image_uri"] == IMAGE and "installed torch 2.8.1" in plan.request["image_source"]
    monkeypatch.setattr(sm_launcher, "_installed", lambda name: {"torch": "2.13.0", "transformers": None}.get(name))
    newest = make_plan(project, text=no_image())
    assert ":2.9.0-transformers5.3.0-gpu-py312" in newest.request["image_uri"] and "newest image older" in newest.request["image_source"]


def test_a_cpu_instance_gets_the_pytorch_image_because_hugging_face_images_are_gpu_only(project, monkeypatch):
    monkeypatch.setattr(sm_launcher, "_installed", lambda name: {"torch": "2.8.0", "transformers": None}.get(name))
    plan = make_plan(project, text=no_image().replace("ml.p3.16xlarge", "ml.m5.xlarge"))
    assert "/pytorch-training:2.8.0-cpu-py312" in plan.request["image_uri"]
    assert "CPU instance" in plan.request["image_source"]


def test_versions_without_an_image_are_a_config_error(project):
    with pytest.raises(ConfigError, match="image_uri"):
        make_plan(project, text=no_image() + "pytorch_version: 0.9.0\ntransformers_version: 9.9.9\n")


# ------------------------------------------------------------------------------------------------
# Credentials and secrets


def test_key_flags_are_kept_in_memory_and_never_in_the_plan(project):
    plan = make_plan(project, aws_access_key_id="AKIAEXAMPLEKEYID", aws_secret_access_key="very-secret-value",
                     extra="additional_args:\n  environment: {HF_TOKEN: hf_job_secret}\n")
    shown = plan.to_json() + plan.describe() + plan.model_dump_json()
    for secret in ("AKIAEXAMPLEKEYID", "very-secret-value", "hf_job_secret"):
        assert secret not in shown
    assert plan.request["credentials"]["source"] == "flags" and plan.request["environment"]["HF_TOKEN"] == "***"
    handle = plan.request["credentials"]["handle"]
    assert set(aws_credentials.secret_values(handle)) == {"AKIAEXAMPLEKEYID", "very-secret-value", "hf_job_secret"}
    aws_credentials.forget(handle)


def test_every_secret_looking_job_variable_is_hidden_by_the_one_rule(project):
    """OPENAI_API_KEY, MY_SERVICE_SECRET and DB_PASSWORD are secret by name, as everywhere else (issue 17)."""
    values = {"OPENAI_API_KEY": "sk-openai-example-1", "MY_SERVICE_SECRET": "svc-secret-2", "DB_PASSWORD": "db-pass-3"}
    env = ", ".join(f"{k}: {v}" for k, v in values.items())
    plan = make_plan(project, extra=f"additional_args:\n  environment: {{{env}, PLAIN: shown}}\n")
    shown = plan.to_json() + plan.describe() + plan.model_dump_json()
    assert not [v for v in values.values() if v in shown]
    assert all(plan.request["environment"][k] == "***" for k in values) and plan.request["environment"]["PLAIN"] == "shown"
    handle = plan.request["credentials"]["handle"]
    assert set(values.values()) <= set(aws_credentials.secret_values(handle))
    aws_credentials.forget(handle)


def test_only_one_key_flag_is_a_usage_error(project):
    with pytest.raises(UsageError, match="Only --aws_secret_access_key was given"):
        make_plan(project, aws_secret_access_key="x")


def test_credentials_come_from_a_block_then_flags_then_the_profile_then_the_environment(project, monkeypatch):
    profile = "profile: research\n"
    assert make_plan(project, extra=profile).request["credentials"] == {"source": "profile", "profile": "research", "block": None, "handle": None}
    assert make_plan(project).request["credentials"]["source"] == "environment"
    flags = make_plan(project, extra=profile, aws_access_key_id="AKIA1", aws_secret_access_key="s3cret")
    assert flags.request["credentials"]["source"] == "flags"  # Accelerate would use the profile here
    monkeypatch.setenv(aws_credentials.AWS_BLOCK_ENV, "team-aws")
    block = make_plan(project, extra=profile, aws_access_key_id="AKIA1", aws_secret_access_key="s3cret")
    assert block.request["credentials"] == {"source": "block", "block": "team-aws", "profile": None, "handle": None}


def test_flag_keys_do_not_outlive_the_launch_that_planned_them():
    from prefect_accelerate.errors import LaunchError

    with pytest.raises(LaunchError, match="never stored in plans"):
        aws_credentials.boto_session(aws_credentials.CredentialSource(source="flags", handle="not-planned-here"), "us-east-1")
