"""SageMaker launches end to end against moto_server on 127.0.0.1 (SageMaker, S3, IAM, STS, CloudWatch Logs).

The SageMaker SDK builds its own clients, so the endpoint comes from AWS_ENDPOINT_URL; role validation and
telemetry are off. A guard refuses any connection that is not loopback for the whole module, so an
accidental call to AWS fails the test. moto reports every job Completed at once and writes no training logs:
log streams are seeded here, and status changes and StopTrainingJob are covered in test_sagemaker_stop.py.
"""

from __future__ import annotations

import base64
import json
import sys
import time
from pathlib import Path

import boto3
import pytest

from prefect_accelerate.cli import main as cli_main
from prefect_accelerate.launchers import plan_launch
from prefect_accelerate.launchers.engines.sagemaker import credentials as aws_credentials
from prefect_accelerate.launchers.engines.sagemaker import job as sagemaker_job
from prefect_accelerate.launchers.execute import execute
from prefect_accelerate.launchers.options import build_launch_options

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fakes"))
from moto_aws import MotoServer, sdk_environment  # noqa: E402
from netguard import guarded  # noqa: E402

pytestmark = pytest.mark.slow

IMAGE = "763104351884.dkr.ecr.us-east-1.amazonaws.com/huggingface-pytorch-training:2.8.0-transformers4.56.2-gpu-py312-cu129-ubuntu22.04"
FLAG_KEY, FLAG_SECRET = "AKIAFLAGKEYEXAMPLE", "flag-secret-never-shown"
HF_SECRET = "hf_job_token_never_shown"
CONFIG = f"""\
compute_environment: AMAZON_SAGEMAKER
distributed_type: DATA_PARALLEL
ec2_instance_type: ml.g5.12xlarge
iam_role_name: SMRole
mixed_precision: bf16
num_machines: 2
region: us-east-1
image_uri: {IMAGE}
base_job_name: my-sweep
sagemaker_inputs_file: inputs.tsv
additional_args:
  code_location: s3://pa-bucket/code
  output_path: s3://pa-bucket/out
  max_run: 3600
  environment: {{HF_TOKEN: {HF_SECRET}, EXTRA: "1"}}
"""


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    server = MotoServer(tmp_path_factory.mktemp("moto")).start()
    yield server
    server.stop()


@pytest.fixture
def aws(moto, tmp_path, monkeypatch, hf_home):
    moto.reset()
    for name, value in sdk_environment(moto, tmp_path).items():
        monkeypatch.setenv(name, value)
    (tmp_path / "aws-credentials").write_text("[research]\naws_access_key_id = RESEARCHKEYID\naws_secret_access_key = research-secret\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))  # mlflow (a SageMaker SDK dependency) writes there
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv(aws_credentials.AWS_BLOCK_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("print('training')\n")
    (tmp_path / "inputs.tsv").write_text("channel\tlocation\ntrain\ts3://pa-data/train\n")
    (tmp_path / "sm.yaml").write_text(CONFIG)
    with guarded() as blocked:
        boto3.client("s3").create_bucket(Bucket="pa-bucket")
        moto.post("/moto-api/recorder/reset-recording")
        moto.post("/moto-api/recorder/start-recording")
        yield moto
        assert not blocked, f"a test tried to leave this machine: {blocked}"


def body(request: dict) -> str:
    raw = request.get("body") or ""
    return base64.b64decode(raw).decode(errors="replace") if request.get("body_encoded") else raw


def requests_to(moto: MotoServer, target: str) -> list[dict]:
    return [r for r in moto.recording() if r["headers"].get("X-Amz-Target") == target]


def created_job(moto: MotoServer) -> dict:
    (request,) = requests_to(moto, "SageMaker.CreateTrainingJob")
    return json.loads(body(request))


def everything_sent(moto: MotoServer) -> str:
    return json.dumps([{**r, "body": body(r)} for r in moto.recording()])


def seed_logs(name: str, streams: dict[str, list[str]]) -> None:
    logs = boto3.client("logs")
    try:
        logs.create_log_group(logGroupName=sagemaker_job.LOG_GROUP)
    except logs.exceptions.ResourceAlreadyExistsException:
        pass
    now = int(time.time() * 1000)  # CloudWatch (and moto) reject events more than 14 days old
    for stream, messages in streams.items():
        logs.create_log_stream(logGroupName=sagemaker_job.LOG_GROUP, logStreamName=f"{name}/{stream}")
        logs.put_log_events(logGroupName=sagemaker_job.LOG_GROUP, logStreamName=f"{name}/{stream}",
                            logEvents=[{"timestamp": now + i, "message": m} for i, m in enumerate(messages)])


def test_cli_launch_creates_the_job_sagemaker_needs(aws, capsys):
    code = cli_main.main(["launch", "--no-track", "--config_file", "sm.yaml", "--aws_access_key_id", FLAG_KEY,
                          "--aws_secret_access_key", FLAG_SECRET, "src/train.py", "--lr", "3e-4", "--epochs", "3", "--fp16", "True"])
    out, err = capsys.readouterr()
    assert code == 0, err
    job = created_job(aws)
    name = job["TrainingJobName"]
    assert name.startswith("my-sweep-") and f"You can find your model data at: s3://pa-bucket/out/{name}/output/model.tar.gz" in out
    assert job["AlgorithmSpecification"]["TrainingImage"] == IMAGE
    assert job["HyperParameters"] == {"lr": "0.0003", "epochs": "3", "fp16": "true"}
    assert job["ResourceConfig"]["InstanceCount"] == 2 and job["ResourceConfig"]["InstanceType"] == "ml.g5.12xlarge"
    assert job["RoleArn"] == "arn:aws:iam::123456789012:role/SMRole"  # the config's role name, expanded (SDK 3 needs an ARN)
    assert job["StoppingCondition"]["MaxRuntimeInSeconds"] == 3600 and job["OutputDataConfig"]["S3OutputPath"] == "s3://pa-bucket/out"
    assert job["Environment"] == {
        "ACCELERATE_USE_SAGEMAKER": "true", "ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_DYNAMO_BACKEND": "NO",
        "ACCELERATE_DYNAMO_MODE": "default", "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False",
        "ACCELERATE_SAGEMAKER_DISTRIBUTED_TYPE": "DATA_PARALLEL", "EXTRA": "1", "HF_TOKEN": HF_SECRET}  # the job needs the real token
    channels = {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in job["InputDataConfig"]}
    assert channels["train"] == "s3://pa-data/train" and {"code", "sm_drivers"} <= set(channels)
    s3 = boto3.client("s3")

    def uploaded(channel: str, file: str) -> str:
        key = f"{channels[channel].removeprefix('s3://pa-bucket/')}/{file}"
        return s3.get_object(Bucket="pa-bucket", Key=key)["Body"].read().decode()

    assert json.loads(uploaded("sm_drivers", "sourcecode.json"))["entry_script"] == "train.py"
    assert "torchrun_driver.py" in uploaded("sm_drivers", "sm_train.sh")  # DATA_PARALLEL: torchrun on every instance
    assert uploaded("code", "train.py") == "print('training')\n"
    # the flag keys signed the requests, and neither key nor token went anywhere else
    assert all(f"Credential={FLAG_KEY}/" in r["headers"]["Authorization"] for r in requests_to(aws, "SageMaker.CreateTrainingJob"))
    assert FLAG_SECRET not in everything_sent(aws)
    for text in (out, err, *(p.read_text() for p in Path(".").rglob("launch.log"))):
        assert FLAG_SECRET not in text and HF_SECRET not in text and FLAG_KEY not in text


def test_the_jobs_log_streams_reach_the_callback_labelled_by_instance_with_secrets_redacted(aws, monkeypatch):
    submit = sagemaker_job.submit

    def submit_then_log(spec, session, secret_env):
        name = submit(spec, session, secret_env)
        seed_logs(name, {"algo-1-1700000000": ["epoch 0 loss 1.0", f"token is {HF_SECRET}"], "algo-2-1700000000": ["epoch 0 loss 1.1"]})
        return name

    monkeypatch.setattr(sagemaker_job, "submit", submit_then_log)
    options = build_launch_options("src/train.py", ["--lr", "1"], config_file="sm.yaml", run_dir=str(Path("run").resolve()))
    plan = plan_launch(options)
    lines: list[tuple[str, str]] = []
    result = execute(plan, on_line=lambda label, line: lines.append((label, line)))
    assert result.succeeded and result.job.status == "Completed" and result.job.name.startswith("my-sweep-")
    assert result.job.model_artifacts == f"s3://pa-bucket/out/{result.job.name}/output/model.tar.gz"
    job_lines = [(label, line) for label, line in lines if label.startswith("algo-")]
    assert job_lines == [("algo-1", "epoch 0 loss 1.0"), ("algo-1", "token is ***"), ("algo-2", "epoch 0 loss 1.1")]
    assert "[algo-2] epoch 0 loss 1.1" in Path(result.log_path).read_text()
    assert HF_SECRET not in result.model_dump_json() + Path(result.log_path).read_text() + plan.to_json() + json.dumps(lines)
    assert not list(sagemaker_job.jobs_dir().glob("*.json"))  # the hook's record is gone once the job ended


def test_the_configs_profile_signs_the_requests(aws):
    Path("sm.yaml").write_text(CONFIG + "profile: research\n")
    options = build_launch_options("src/train.py", [], config_file="sm.yaml", run_dir=str(Path("run").resolve()))
    result = execute(plan_launch(options))
    assert result.succeeded
    assert all("Credential=RESEARCHKEYID/" in r["headers"]["Authorization"] for r in requests_to(aws, "SageMaker.CreateTrainingJob"))


def test_an_accidental_call_to_aws_fails_instead_of_leaving_the_machine(aws, monkeypatch):
    from botocore.exceptions import EndpointConnectionError

    from netguard import BLOCKED

    monkeypatch.delenv("AWS_ENDPOINT_URL")
    before = len(BLOCKED)
    with pytest.raises((EndpointConnectionError, PermissionError)):
        boto3.client("sagemaker", region_name="us-east-1").list_training_jobs()
    assert any("amazonaws.com" in entry for entry in BLOCKED[before:])
    del BLOCKED[before:]  # expected here; the fixture fails a test on any other attempt


def test_tracked_launch_with_a_credentials_block_keeps_secrets_out_of_prefect(aws, prefect_harness, monkeypatch):
    import asyncio

    from prefect.client.orchestration import get_client
    from pydantic import SecretStr

    from prefect_accelerate.blocks import AccelerateAwsCredentials
    from prefect_accelerate.flows.launch import launch_flow

    AccelerateAwsCredentials(aws_access_key_id=SecretStr("BLOCKKEYID"), aws_secret_access_key=SecretStr("block-secret-value"),
                             region_name="eu-west-1").save("sm-test-creds", overwrite=True)
    monkeypatch.setenv(aws_credentials.AWS_BLOCK_ENV, "sm-test-creds")
    options = build_launch_options("src/train.py", ["--lr", "1"], config_file="sm.yaml", run_dir=str(Path("run").resolve()),
                                   aws_access_key_id=FLAG_KEY, aws_secret_access_key=FLAG_SECRET)
    plan = plan_launch(options)
    state = launch_flow(options=options, plan=plan, return_state=True)
    result = state.result()
    assert result.succeeded and result.job.status == "Completed"
    assert all("Credential=BLOCKKEYID/" in r["headers"]["Authorization"] for r in requests_to(aws, "SageMaker.CreateTrainingJob"))
    assert "block-secret-value" not in everything_sent(aws) and FLAG_SECRET not in everything_sent(aws)

    async def stored() -> tuple[str, str]:
        # this run's records only: the session's server holds every other test's too, past the API's default limit
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId

        run_id = state.state_details.flow_run_id
        async with get_client() as client:
            run = await client.read_flow_run(run_id)
            artifacts = await client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
            logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
            return json.dumps(run.parameters, default=str), json.dumps([a.data for a in artifacts], default=str) + \
                json.dumps([entry.message for entry in logs])

    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)  # logs ship in batches from a background worker: send them all before reading
    parameters, published = asyncio.run(stored())
    assert result.job.name in published  # the job's name reached Prefect's logs and artifact...
    for secret in (FLAG_SECRET, "block-secret-value", HF_SECRET):  # ...and no secret did
        assert secret not in published
    for secret in (FLAG_SECRET, "block-secret-value"):  # the key flags are SecretStr in the options parameter
        assert secret not in parameters


def test_the_job_handle_from_a_plan_attaches_by_name_and_fetches_the_result(aws):
    import anyio

    options = build_launch_options("src/train.py", ["--lr", "1"], config_file="sm.yaml", run_dir=str(Path("run").resolve()))
    plan = plan_launch(options)
    own_lines: list[tuple[str, str]] = []
    submitted = sagemaker_job.SageMakerJobRun.from_plan(plan, poll_seconds=0.05, output=lambda label, line: own_lines.append((label, line)))
    assert created_job(aws)["TrainingJobName"] == submitted.name and submitted.name.startswith("my-sweep-")
    handle = sagemaker_job.SageMakerJobSpec.model_validate(plan.request).handle
    assert aws_credentials.secret_values(handle) == [] and not aws_credentials.secret_environment(handle)  # forgotten once submitted
    seed_logs(submitted.name, {"algo-1-1700000000": ["epoch 0 loss 1.0", f"token is {HF_SECRET}"]})
    # another process would only know the name: a second handle, attached by name, follows the same job
    lines: list[tuple[str, str]] = []
    # (moto's DescribeTrainingJob has no Environment, from which a real job's HF_TOKEN is redacted: see
    # test_sagemaker_stop.py; here the value is handed over)
    attached = sagemaker_job.SageMakerJobRun.attach(submitted.name, "us-east-1", output=lambda label, line: lines.append((label, line)),
                                                    poll_seconds=0.05, secrets=[HF_SECRET])

    async def follow() -> sagemaker_job.SageMakerJob:
        await attached.wait_for_completion()
        return await attached.fetch_result()

    job = anyio.run(follow)
    assert (job.name, job.status, job.instance_count) == (submitted.name, "Completed", 2)
    assert job.model_artifacts == f"s3://pa-bucket/out/{submitted.name}/output/model.tar.gz"
    assert job.image == IMAGE and attached.finished
    assert lines[:2] == [("algo-1", "epoch 0 loss 1.0"), ("algo-1", "token is ***")]
    assert lines[2][0] == "sagemaker" and lines[2][1].startswith(f"{submitted.name}: Completed")
    # the handle made from the plan knew the job's HF_TOKEN (a secret job variable) and redacts it itself
    assert submitted.wait(timeout=30).status == "Completed" and submitted.result().name == submitted.name
    assert ("algo-1", "token is ***") in own_lines and HF_SECRET not in repr(own_lines)
