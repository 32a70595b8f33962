"""What moto cannot show: a job's status changing, StopTrainingJob, failures. botocore's Stubber plays SageMaker
and CloudWatch Logs here, checking every call's parameters (moto answers StopTrainingJob with "not implemented"
and reports every job Completed at once).
"""

from __future__ import annotations

import datetime as dt
import sys
import time
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber

from prefect_accelerate.errors import LaunchError
from prefect_accelerate.launchers.engines.sagemaker import credentials as aws_credentials
from prefect_accelerate.launchers.engines.sagemaker import job as sagemaker_job
from prefect_accelerate.launchers.plan import LaunchPlan
from prefect_accelerate.launchers.engines.sagemaker.plan import SageMakerJobSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fakes"))
from netguard import guarded  # noqa: E402

JOB = "accelerate-sagemaker-1-abc123-20260101000000"
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


@pytest.fixture(autouse=True)
def no_network(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "stub-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "stub-secret")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with guarded() as blocked:
        yield
        assert not blocked, blocked


def description(status: str, secondary: str | None = None, **extra) -> dict:
    return {
        "TrainingJobName": JOB, "TrainingJobArn": f"arn:aws:sagemaker:us-east-1:123456789012:training-job/{JOB}",
        "ModelArtifacts": {"S3ModelArtifacts": f"s3://bucket/out/{JOB}/output/model.tar.gz"},
        "TrainingJobStatus": status, "SecondaryStatus": secondary or status,
        "AlgorithmSpecification": {"TrainingImage": "image:1", "TrainingInputMode": "File"},
        "ResourceConfig": {"InstanceType": "ml.g5.xlarge", "InstanceCount": 2, "VolumeSizeInGB": 30},
        "StoppingCondition": {"MaxRuntimeInSeconds": 3600}, "CreationTime": NOW, **extra,
    }


def clients():
    session = boto3.Session(region_name="us-east-1")
    sm, logs = session.client("sagemaker"), session.client("logs")
    return sm, Stubber(sm), logs, Stubber(logs)


def expect_no_logs(stub: Stubber) -> None:
    stub.add_client_error("describe_log_streams", service_error_code="ResourceNotFoundException", http_status_code=400,
                          expected_params={"logGroupName": sagemaker_job.LOG_GROUP, "logStreamNamePrefix": f"{JOB}/"})


def expect_logs(stub: Stubber, streams: dict[str, list[str]], tokens: dict[str, str | None]) -> None:
    stub.add_response("describe_log_streams", {"logStreams": [{"logStreamName": s} for s in streams]},
                      {"logGroupName": sagemaker_job.LOG_GROUP, "logStreamNamePrefix": f"{JOB}/"})
    for stream, messages in streams.items():
        params = {"logGroupName": sagemaker_job.LOG_GROUP, "logStreamName": stream, "startFromHead": True}
        if tokens.get(stream):
            params["nextToken"] = tokens[stream]
        new_token = f"f/{stream}/{len(messages)}"
        events = [{"timestamp": 1, "message": m, "ingestionTime": 1} for m in messages]
        stub.add_response("get_log_events", {"events": events, "nextForwardToken": new_token, "nextBackwardToken": "b"}, params)
        if messages:  # the follower reads on until a page adds nothing
            stub.add_response("get_log_events", {"events": [], "nextForwardToken": new_token, "nextBackwardToken": "b"},
                              {**params, "nextToken": new_token})
        tokens[stream] = new_token


def test_stop_job_sends_stop_training_job_for_the_job():
    sm, stub, _, _ = clients()
    stub.add_response("stop_training_job", {}, {"TrainingJobName": JOB})
    with stub:
        assert sagemaker_job.stop_job(sm, JOB) is True
    stub.assert_no_pending_responses()


def test_stopping_a_job_that_already_finished_is_not_an_error():
    sm, stub, _, _ = clients()
    stub.add_client_error("stop_training_job", service_error_code="ValidationException",
                          service_message="The job status is Completed", expected_params={"TrainingJobName": JOB})
    with stub:
        assert sagemaker_job.stop_job(sm, JOB) is False


def test_other_stop_errors_are_raised():
    from botocore.exceptions import ClientError

    sm, stub, _, _ = clients()
    stub.add_client_error("stop_training_job", service_error_code="AccessDeniedException", expected_params={"TrainingJobName": JOB})
    with stub, pytest.raises(ClientError):
        sagemaker_job.stop_job(sm, JOB)


def test_the_handle_follows_status_changes_and_streams_each_instances_log_lines_in_order():
    sm, sm_stub, logs, logs_stub = clients()
    tokens: dict[str, str | None] = {}
    a1, a2 = f"{JOB}/algo-1-1700000000", f"{JOB}/algo-2-1700000000"
    sm_stub.add_response("describe_training_job", description("InProgress", "Starting"), {"TrainingJobName": JOB})
    expect_no_logs(logs_stub)
    sm_stub.add_response("describe_training_job", description("InProgress", "Training"), {"TrainingJobName": JOB})
    expect_logs(logs_stub, {a1: ["epoch 0", "epoch 1"], a2: ["epoch 0"]}, tokens)
    sm_stub.add_response("describe_training_job", description("Completed", "Completed", BillableTimeInSeconds=42),
                         {"TrainingJobName": JOB})
    expect_logs(logs_stub, {a1: ["saved"], a2: []}, tokens)
    lines: list[tuple[str, str]] = []
    sleeps: list[float] = []
    job_run = sagemaker_job.SageMakerJobRun(JOB, sm, logs, "us-east-1", output=lambda label, line: lines.append((label, line)),
                                            poll_seconds=7, sleep=sleeps.append)
    with sm_stub, logs_stub:
        final = job_run.wait()
    assert job_run.finished and final.status == "Completed" and final.billable_seconds == 42 and sleeps == [7, 7]
    assert job_run.result().model_artifacts == f"s3://bucket/out/{JOB}/output/model.tar.gz"  # no further call: it has ended
    assert lines == [
        ("sagemaker", f"{JOB}: InProgress (Starting)"),
        ("algo-1", "epoch 0"), ("algo-1", "epoch 1"), ("algo-2", "epoch 0"),
        ("sagemaker", f"{JOB}: InProgress (Training)"),
        ("algo-1", "saved"),
        ("sagemaker", f"{JOB}: Completed (Completed)"),
    ]
    sm_stub.assert_no_pending_responses()
    logs_stub.assert_no_pending_responses()


def handle(sm, logs, lines: list | None = None, **kwargs) -> sagemaker_job.SageMakerJobRun:
    output = (lambda label, line: lines.append((label, line))) if lines is not None else None
    return sagemaker_job.SageMakerJobRun(JOB, sm, logs, "us-east-1", output=output, poll_seconds=0, sleep=lambda s: None, **kwargs)


def test_wait_with_a_timeout_returns_the_running_job_and_stop_ends_it():
    sm, sm_stub, logs, logs_stub = clients()
    sm_stub.add_response("describe_training_job", description("InProgress", "Training"), {"TrainingJobName": JOB})
    expect_no_logs(logs_stub)
    sm_stub.add_response("describe_training_job", description("InProgress", "Training"), {"TrainingJobName": JOB})  # result()
    sm_stub.add_response("stop_training_job", {}, {"TrainingJobName": JOB})
    sm_stub.add_response("describe_training_job", description("Stopping", "Stopping"), {"TrainingJobName": JOB})
    sm_stub.add_response("describe_training_job", description("Stopped", "Stopped"), {"TrainingJobName": JOB})
    lines: list[tuple[str, str]] = []
    job_run = handle(sm, logs, lines)
    with sm_stub, logs_stub:
        assert job_run.wait(timeout=0).status == "InProgress" and not job_run.finished
        with pytest.raises(LaunchError, match=f"{JOB} is still InProgress"):
            job_run.result()
        stopped = job_run.stop(wait_seconds=30)
    assert stopped.status == "Stopped" and job_run.finished
    assert ("sagemaker", f"Stopping training job {JOB}") in lines
    sm_stub.assert_no_pending_responses()
    with pytest.raises(LaunchError, match=f"training job {JOB} stopped: no reason given"):
        job_run.result()


def test_the_handle_as_a_context_manager_stops_the_job_on_an_exception_only():
    sm, sm_stub, logs, logs_stub = clients()
    sm_stub.add_response("describe_training_job", description("InProgress", "Training"), {"TrainingJobName": JOB})
    expect_no_logs(logs_stub)
    sm_stub.add_response("stop_training_job", {}, {"TrainingJobName": JOB})
    sm_stub.add_response("describe_training_job", description("Stopped", "Stopped"), {"TrainingJobName": JOB})
    with sm_stub, logs_stub, pytest.raises(KeyboardInterrupt):
        with handle(sm, logs, []) as job_run:
            job_run.poll()
            raise KeyboardInterrupt
    sm_stub.assert_no_pending_responses()
    # a clean exit sends nothing: the stubber would fail on an unexpected StopTrainingJob
    with sm_stub, handle(sm, logs, []):
        pass


def test_a_failed_jobs_result_raises_with_its_failure_reason():
    sm, sm_stub, logs, _ = clients()
    reason = "ClientError: Data download failed: s3://pa-data/train does not exist"
    sm_stub.add_response("describe_training_job", description("Failed", "Failed", FailureReason=reason), {"TrainingJobName": JOB})
    with sm_stub, pytest.raises(LaunchError, match="Data download failed") as caught:
        handle(sm, logs).result()
    assert f"training job {JOB} failed" in str(caught.value) and "console.aws.amazon.com" in str(caught.value)


def test_attach_finds_a_job_by_name_with_the_credentials_given(monkeypatch):
    sm, sm_stub, logs, _ = clients()
    seen = []
    monkeypatch.setattr(aws_credentials, "boto_session", lambda source, region: seen.append((source.source, region)) or StubSession(sm, logs))
    sm_stub.add_response("describe_training_job", description("Completed", "Completed"), {"TrainingJobName": JOB})
    job_run = sagemaker_job.SageMakerJobRun.attach(JOB, "eu-west-1", aws_credentials.CredentialSource(source="profile", profile="research"))
    with sm_stub:
        assert job_run.describe().status == "Completed" and job_run.region == "eu-west-1"
    assert seen == [("profile", "eu-west-1")]


def test_in_a_flow_the_handle_is_prefects_job_run_and_logs_to_the_run_logger(prefect_harness, monkeypatch):
    """`await wait_for_completion()` / `await fetch_result()` (Prefect's JobRun interface) in a flow; lines reach the run's logs."""
    import asyncio

    from prefect import flow
    from prefect.blocks.abstract import JobRun
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    sm, sm_stub, logs, logs_stub = clients()
    tokens: dict[str, str | None] = {}
    secret = "hf_never_in_prefect_logs"
    sm_stub.add_response("describe_training_job", description("InProgress", "Training", Environment={"HF_TOKEN": secret}),
                         {"TrainingJobName": JOB})
    expect_logs(logs_stub, {f"{JOB}/algo-1-1700000000": ["epoch 0 loss 0.5", f"logged in with {secret}"]}, tokens)
    sm_stub.add_response("describe_training_job", description("Completed", "Completed", BillableTimeInSeconds=9), {"TrainingJobName": JOB})
    expect_logs(logs_stub, {f"{JOB}/algo-1-1700000000": []}, tokens)
    job_run = handle(sm, logs)
    assert isinstance(job_run, JobRun)

    @flow
    async def follow():
        from prefect.runtime import flow_run

        await job_run.wait_for_completion()
        return flow_run.id, await job_run.fetch_result()

    with sm_stub, logs_stub:
        run_id, job = asyncio.run(follow())
    assert job.status == "Completed" and job.billable_seconds == 9
    sm_stub.assert_no_pending_responses()
    APILogWorker.drain_all()

    async def messages() -> list[str]:
        async with get_client() as client:
            found = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
            return [entry.message for entry in found]

    deadline = time.monotonic() + 20
    while "[algo-1] epoch 0 loss 0.5" not in (got := asyncio.run(messages())) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "[algo-1] epoch 0 loss 0.5" in got and f"[sagemaker] {JOB}: Completed (Completed)" in got
    # the job's HF_TOKEN, printed by the script, reaches Prefect's logs only as ***
    assert "[algo-1] logged in with ***" in got and not any(secret in message for message in got)


# ------------------------------------------------------------------------------------------------
# run_job with stubbed clients: interrupts, deadlines, failures


class StubSession:
    region_name = "us-east-1"

    def __init__(self, sm, logs):
        self._clients = {"sagemaker": sm, "logs": logs}

    def client(self, name, **kwargs):
        return self._clients[name]


def spec_plan(tmp_path, **changes) -> LaunchPlan:
    spec = SageMakerJobSpec(
        region="us-east-1", credentials=aws_credentials.CredentialSource(source="environment"), role="arn:aws:iam::1:role/R",
        base_job_name="accelerate-sagemaker-1-abc123", image_uri="image:1", image_source="test", source_dir=str(tmp_path),
        entry_script="train.py", instance_type="ml.g5.xlarge", instance_count=2, **changes,
    )
    return LaunchPlan(launcher="sagemaker", argv=("python", "train.py"), cwd=str(tmp_path), run_dir=str(tmp_path / "run"),
                      request=spec.model_dump(mode="json"))


@pytest.fixture
def stubbed(monkeypatch):
    sm, sm_stub, logs, logs_stub = clients()
    monkeypatch.setattr(aws_credentials, "boto_session", lambda source, region: StubSession(sm, logs))
    monkeypatch.setattr(sagemaker_job, "submit", lambda spec, session, secret_env: JOB)
    return sm_stub, logs_stub


def test_an_interrupt_while_watching_stops_the_job_then_goes_on(tmp_path, stubbed):
    sm_stub, logs_stub = stubbed
    sm_stub.add_response("describe_training_job", description("InProgress", "Training"), {"TrainingJobName": JOB})
    expect_no_logs(logs_stub)
    sm_stub.add_response("stop_training_job", {}, {"TrainingJobName": JOB})
    sm_stub.add_response("describe_training_job", description("Stopped", "Stopped"), {"TrainingJobName": JOB})
    recorded: list[str] = []

    def interrupted(seconds):
        recorded.extend(p.stem for p in sagemaker_job.jobs_dir().glob("*.json"))
        raise KeyboardInterrupt

    with sm_stub, logs_stub, pytest.raises(KeyboardInterrupt):
        sagemaker_job.run_job(spec_plan(tmp_path), poll_seconds=0, sleep=interrupted)
    sm_stub.assert_no_pending_responses()
    assert recorded == ["run"]  # recorded for the cancellation hook while it ran...
    assert not list(sagemaker_job.jobs_dir().glob("*.json"))  # ...and forgotten once stopped
    assert "Stopping training job" in (tmp_path / "run" / "launch.log").read_text()


def test_the_deadline_stops_the_job_and_reports_a_timeout(tmp_path, stubbed):
    sm_stub, logs_stub = stubbed
    sm_stub.add_response("describe_training_job", description("InProgress", "Training"), {"TrainingJobName": JOB})
    expect_no_logs(logs_stub)
    sm_stub.add_response("stop_training_job", {}, {"TrainingJobName": JOB})
    sm_stub.add_response("describe_training_job", description("Stopped", "Stopped"), {"TrainingJobName": JOB})
    with sm_stub, logs_stub:
        result = sagemaker_job.run_job(spec_plan(tmp_path), timeout=1e-9, poll_seconds=0, sleep=lambda s: None)
    assert result.timed_out and result.exit_code == 124 and result.job.status == "Stopped"
    sm_stub.assert_no_pending_responses()


def test_a_failed_job_raises_with_its_failure_reason(tmp_path, stubbed):
    sm_stub, logs_stub = stubbed
    reason = "AlgorithmError: ExecuteUserScriptError: exit code 1 (CUDA out of memory)"
    sm_stub.add_response("describe_training_job", description("Failed", "Failed", FailureReason=reason, BillableTimeInSeconds=61),
                         {"TrainingJobName": JOB})
    expect_no_logs(logs_stub)
    with sm_stub, logs_stub:
        result = sagemaker_job.run_job(spec_plan(tmp_path), poll_seconds=0, sleep=lambda s: None)
    assert result.exit_code == 1 and result.job.failure_reason == reason and result.job.billable_seconds == 61
    with pytest.raises(LaunchError, match="CUDA out of memory"):
        result.raise_for_failure()
    assert not list(sagemaker_job.jobs_dir().glob("*.json"))


def test_the_cancellation_hook_stops_recorded_jobs_of_its_flow_run_only(tmp_path, monkeypatch):
    sm, sm_stub, logs, _ = clients()
    monkeypatch.setattr(aws_credentials, "boto_session", lambda source, region: StubSession(sm, logs))
    credentials = aws_credentials.CredentialSource(source="flags", handle="gone").model_dump()
    sagemaker_job.record_job("mine", {"job_name": JOB, "region": "us-east-1", "credentials": credentials, "flow_run_id": "run-1"})
    sagemaker_job.record_job("other", {"job_name": "other-job", "region": "us-east-1", "credentials": credentials, "flow_run_id": "run-2"})
    sm_stub.add_response("stop_training_job", {}, {"TrainingJobName": JOB})
    with sm_stub:
        assert sagemaker_job.stop_recorded_jobs("run-1") == [JOB]
        assert sagemaker_job.stop_recorded_jobs("run-1") == []  # idempotent
    sm_stub.assert_no_pending_responses()
    assert [p.stem for p in sagemaker_job.jobs_dir().glob("*.json")] == ["other"]
    sagemaker_job.forget_job("other")


def test_the_flow_hook_itself_stops_the_recorded_job(tmp_path, monkeypatch, capsys):
    """What Prefect calls on cancellation/crash (flows/launch.end_launch_processes) reaches StopTrainingJob."""
    from types import SimpleNamespace

    from prefect_accelerate.flows.launch import end_launch_processes

    sm, sm_stub, logs, _ = clients()
    monkeypatch.setattr(aws_credentials, "boto_session", lambda source, region: StubSession(sm, logs))
    credentials = aws_credentials.CredentialSource(source="flags", handle="gone").model_dump()
    sagemaker_job.record_job("hooked", {"job_name": JOB, "region": "us-east-1", "credentials": credentials, "flow_run_id": "run-9"})
    sm_stub.add_response("stop_training_job", {}, {"TrainingJobName": JOB})
    with sm_stub:
        end_launch_processes(None, SimpleNamespace(id="run-9"), None)  # outside a run: it reports by print
    sm_stub.assert_no_pending_responses()
    assert not list(sagemaker_job.jobs_dir().glob("*.json"))
    assert JOB in capsys.readouterr().out
