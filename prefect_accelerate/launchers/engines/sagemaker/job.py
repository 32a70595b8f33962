"""A SageMaker training job's lifecycle: submit, follow (status and CloudWatch logs), stop, report.

`SageMakerJobRun` is the handle on one job (Prefect's `JobRun`): `submit` builds the job with the
SageMaker SDK 3 (`ModelTrainer`: the SDK uploads the source folder and its drivers to S3 and calls
CreateTrainingJob); `poll`/`wait` follow it with plain boto3 calls, DescribeTrainingJob every few seconds
and the job's log streams (`/aws/sagemaker/TrainingJobs`, `<job>/algo-N-...`) labelled `algo-N`; `stop`
sends StopTrainingJob; `result` returns the finished job or raises with its FailureReason.

`run_job(plan, ...)` is what `execute()` calls for a SageMaker plan: it submits, follows the job into
`on_line` and turns the outcome into a SageMakerLaunchResult.
A deadline, Ctrl-C, SIGTERM or a Prefect cancellation stops the job (StopTrainingJob) before the
exception goes on; the job's name is recorded in a state file so the flow's cancellation hook can stop
it too (`stop_recorded_jobs`). A failed job's FailureReason becomes the LaunchError's message.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect.blocks.abstract import JobRun
from pydantic import BaseModel

from prefect_accelerate.errors import DependencyError, LaunchError
from prefect_accelerate.signals import sigterm_as_exception
from prefect_accelerate.launchers.engines.sagemaker import credentials as aws_credentials
from prefect_accelerate.secrets import Redactor, is_secret_name
from prefect_accelerate.launchers.plan import LaunchPlan
from prefect_accelerate.launchers.result import TIMEOUT_EXIT_CODE, LaunchResult
from prefect_accelerate.launchers.engines.sagemaker.plan import SageMakerJobSpec
from prefect_accelerate.launchers.state import SAGEMAKER_JOBS, make_private_dir, new_run_dir, read_records, remove_record, state_dir, write_record

LOG_GROUP = "/aws/sagemaker/TrainingJobs"
#: seconds between status checks (SageMaker's own console refreshes about this often)
POLL_SECONDS = 10.0
TERMINAL = ("Completed", "Failed", "Stopped")
TAIL_LINES = 200
#: how long a stop waits for the job to leave InProgress before giving up watching (the stop was sent)
STOP_WAIT_SECONDS = 15.0

LineCallback = Callable[[str, str], None]


class SageMakerJob(BaseModel):
    """What SageMaker says about a training job."""

    name: str
    arn: str | None = None
    region: str
    status: str
    secondary_status: str | None = None
    failure_reason: str | None = None
    model_artifacts: str | None = None
    billable_seconds: int | None = None
    training_seconds: int | None = None
    image: str | None = None
    instance_type: str | None = None
    instance_count: int | None = None

    @property
    def console_url(self) -> str:
        return f"https://{self.region}.console.aws.amazon.com/sagemaker/home?region={self.region}#/jobs/{self.name}"

    @classmethod
    def from_description(cls, data: dict[str, Any], region: str) -> SageMakerJob:
        resources = data.get("ResourceConfig") or {}
        return cls(
            name=data["TrainingJobName"], arn=data.get("TrainingJobArn"), region=region, status=data.get("TrainingJobStatus", "Unknown"),
            secondary_status=data.get("SecondaryStatus"), failure_reason=data.get("FailureReason"),
            model_artifacts=(data.get("ModelArtifacts") or {}).get("S3ModelArtifacts"),
            billable_seconds=data.get("BillableTimeInSeconds"), training_seconds=data.get("TrainingTimeInSeconds"),
            image=(data.get("AlgorithmSpecification") or {}).get("TrainingImage"),
            instance_type=resources.get("InstanceType"), instance_count=resources.get("InstanceCount"),
        )


class SageMakerLaunchResult(LaunchResult):
    """A LaunchResult that also carries the training job (name, status, model artifacts, billable time)."""

    job: SageMakerJob | None = None


# ------------------------------------------------------------------------------------------------
# State files for the cancellation hook (no secrets: the credentials' source only)


def jobs_dir() -> Path:
    return state_dir() / SAGEMAKER_JOBS


def record_job(launch_id: str, data: dict[str, Any]) -> Path:
    return write_record(SAGEMAKER_JOBS, launch_id, data)


def forget_job(launch_id: str) -> None:
    remove_record(SAGEMAKER_JOBS, launch_id)


def stop_job(client, name: str) -> bool:
    """StopTrainingJob; False (not an error) when the job has already finished."""
    from botocore.exceptions import ClientError

    try:
        client.stop_training_job(TrainingJobName=name)
        return True
    except ClientError as error:
        if error.response.get("Error", {}).get("Code") == "ValidationException":
            return False  # "The job status is Completed/Failed/Stopped": nothing to stop
        raise


def stop_recorded_jobs(flow_run_id: str | None = None) -> list[str]:
    """Hook helper: stop the SageMaker jobs recorded for `flow_run_id` (all recorded ones when None). Idempotent.

    Jobs launched with flag keys are stopped with the environment's credentials (keys are never written down).
    """
    stopped: list[str] = []
    # a job can be stopped from any host that has credentials, so records of other hosts count too
    for data in read_records(SAGEMAKER_JOBS, flow_run_id, this_host=False):
        path = Path(data["_path"])
        source = aws_credentials.CredentialSource.model_validate(data.get("credentials") or {"source": "environment"})
        if source.source == "flags":
            source = aws_credentials.CredentialSource(source="environment")
        try:
            session = aws_credentials.boto_session(source, data["region"])
            if stop_job(session.client("sagemaker"), data["job_name"]):
                stopped.append(data["job_name"])
        except Exception as error:  # a hook must not fail on one job; say what was left running
            print(f"prefect-accelerate: could not stop SageMaker job {data.get('job_name')}: {error}")
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return stopped


# ------------------------------------------------------------------------------------------------
# Logs


class LogFollower:
    """Reads every `<job>/algo-N-...` stream of the job from where it stopped last time."""

    def __init__(self, client, job_name: str) -> None:
        self.client = client
        self.job_name = job_name
        self.tokens: dict[str, str | None] = {}

    @staticmethod
    def label(stream: str) -> str:
        tail = stream.split("/", 1)[-1]
        head, _, stamp = tail.rpartition("-")
        return head if head and stamp.isdigit() else tail

    def streams(self) -> list[str]:
        from botocore.exceptions import ClientError

        names: list[str] = []
        kwargs: dict[str, Any] = {"logGroupName": LOG_GROUP, "logStreamNamePrefix": f"{self.job_name}/"}
        try:
            while True:
                page = self.client.describe_log_streams(**kwargs)
                names += [s["logStreamName"] for s in page.get("logStreams", [])]
                if not page.get("nextToken"):
                    return names
                kwargs["nextToken"] = page["nextToken"]
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") == "ResourceNotFoundException":
                return names  # no logs yet: the group appears when the first instance starts
            raise

    def poll(self) -> list[tuple[str, str]]:
        lines: list[tuple[str, str]] = []
        for stream in self.streams():
            while True:
                kwargs: dict[str, Any] = {"logGroupName": LOG_GROUP, "logStreamName": stream, "startFromHead": True}
                if self.tokens.get(stream):
                    kwargs["nextToken"] = self.tokens[stream]
                page = self.client.get_log_events(**kwargs)
                events = page.get("events", [])
                lines += [(self.label(stream), e.get("message", "").rstrip("\n")) for e in events]
                token = page.get("nextForwardToken")
                done = not events or token == self.tokens.get(stream)
                self.tokens[stream] = token
                if done:
                    break
        return lines


# ------------------------------------------------------------------------------------------------
# Submit and watch


def _import_sdk():
    try:
        with warnings.catch_warnings():  # the SDK's own ModelTrainer imports its deprecated configs shim
            warnings.filterwarnings("ignore", message="sagemaker.train.configs has been moved", category=DeprecationWarning)
            from sagemaker.train import ModelTrainer
        from sagemaker.core.helper.session_helper import Session
        from sagemaker.core.training.configs import (
            CheckpointConfig,
            Compute,
            InputData,
            Networking,
            OutputDataConfig,
            SourceCode,
            StoppingCondition,
        )
        from sagemaker.train.distributed import MPI, Torchrun
    except ImportError:
        raise DependencyError.missing("sagemaker", "sagemaker", "Launching a SageMaker training job") from None
    return locals()


def role_arn(role: str, session) -> str:
    """The role as an ARN (SDK 3 needs one; Accelerate's config holds a name, which SDK 2 expanded)."""
    if role.startswith("arn:"):
        return role
    account = session.client("sts").get_caller_identity()["Account"]
    partition = "aws-cn" if session.region_name.startswith("cn-") else "aws-us-gov" if session.region_name.startswith("us-gov-") else "aws"
    return f"arn:{partition}:iam::{account}:role/{role}"


def build_trainer(spec: SageMakerJobSpec, session, secret_env: dict[str, str]):
    """The ModelTrainer for `spec` (SDK objects only; nothing is sent yet)."""
    sdk = _import_sdk()
    bucket, prefix = None, None
    if spec.code_location:
        bucket, _, prefix = spec.code_location.removeprefix("s3://").partition("/")
    sm_session = sdk["Session"](boto_session=session, default_bucket=bucket, default_bucket_prefix=prefix or None)
    distributed = None
    if spec.distribution and "torchrun" in spec.distribution:
        distributed = sdk["Torchrun"](**{k: v for k, v in spec.distribution["torchrun"].items() if v is not None})
    elif spec.distribution and "mpi" in spec.distribution:
        distributed = sdk["MPI"](**{k: v for k, v in spec.distribution["mpi"].items() if v is not None})
    environment = {**spec.environment, **secret_env}
    kwargs: dict[str, Any] = dict(
        sagemaker_session=sm_session, role=role_arn(spec.role, session), base_job_name=spec.base_job_name,
        training_image=spec.image_uri,
        source_code=sdk["SourceCode"](source_dir=spec.source_dir, entry_script=spec.entry_script, requirements=spec.requirements),
        compute=sdk["Compute"](instance_type=spec.instance_type, instance_count=spec.instance_count, **spec.compute),
        distributed=distributed, environment=environment, hyperparameters=dict(spec.hyperparameters),
    )
    if spec.stopping_condition:
        kwargs["stopping_condition"] = sdk["StoppingCondition"](**spec.stopping_condition)
    if spec.networking:
        kwargs["networking"] = sdk["Networking"](**spec.networking)
    if spec.output_path or spec.output_kms_key or spec.output_compression:
        kwargs["output_data_config"] = sdk["OutputDataConfig"](
            s3_output_path=spec.output_path, kms_key_id=spec.output_kms_key, compression_type=spec.output_compression)
    if spec.checkpoint_s3_uri:
        kwargs["checkpoint_config"] = sdk["CheckpointConfig"](s3_uri=spec.checkpoint_s3_uri, local_path=spec.checkpoint_local_path)
    if spec.training_input_mode:
        kwargs["training_input_mode"] = spec.training_input_mode
    if spec.tags:
        kwargs["tags"] = [{"key": t["Key"], "value": t["Value"]} for t in spec.tags]
    trainer = sdk["ModelTrainer"](**kwargs)
    inputs = [sdk["InputData"](channel_name=name, data_source=location) for name, location in spec.inputs.items()]
    return trainer, inputs


def submit(spec: SageMakerJobSpec, session, secret_env: dict[str, str]) -> str:
    """Create the job; returns its name (read from the CreateTrainingJob request the SDK sent)."""
    trainer, inputs = build_trainer(spec, session, secret_env)
    sent: dict[str, Any] = {}

    def capture(params, **kwargs):  # noqa: ARG001 - botocore's event signature
        sent["name"] = params.get("TrainingJobName")

    session.events.register("provide-client-params.sagemaker.CreateTrainingJob", capture)
    try:
        trainer.train(input_data_config=inputs or None, wait=False, logs=False)
    finally:
        session.events.unregister("provide-client-params.sagemaker.CreateTrainingJob", capture)
    name = sent.get("name") or getattr(getattr(trainer, "_latest_training_job", None), "training_job_name", None)
    if not name:
        raise LaunchError("The SageMaker SDK returned without creating a training job (no CreateTrainingJob call was made).")
    return name


class _Output:
    """Labelled lines to the callback, the log file and the tail, with secrets redacted."""

    def __init__(self, on_line: LineCallback | None, log_path: Path, secrets: list[str]) -> None:
        self.on_line = on_line
        self.log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.redact = Redactor(secrets)

    def __call__(self, label: str, line: str) -> None:
        line = self.redact(line)
        self.log.write(f"[{label}] {line}\n")
        self.log.flush()
        self.tail.append(line)
        if self.on_line is not None:
            with contextlib.suppress(Exception):
                self.on_line(label, line)

    def close(self) -> None:
        self.log.close()


class SageMakerJobRun(JobRun[SageMakerJob]):
    """A handle on one training job: its status, its logs, stopping it, waiting for it, its result.

    It is Prefect's `JobRun`: in a flow, `await job.wait_for_completion()` then `await job.fetch_result()`;
    anywhere, the plain methods do the same synchronously. Used as a context manager, it stops the job
    when the block exits with an exception (Ctrl-C, SIGTERM, a Prefect cancellation):

        with SageMakerJobRun.submit(spec, session, secret_env) as job:
            job.wait(timeout=3600)
        print(job.result().model_artifacts)

    Log lines and status changes go to `output(label, line)`: labels are `algo-N` for the instances'
    CloudWatch streams and `sagemaker` for the job itself. Without an `output`, they go to the run logger.
    Either way the values of the job's secret-named environment variables (HF_TOKEN, ...) and of `secrets`
    are replaced by *** first: a training script that prints its token does not leak it into Prefect.
    """

    def __init__(self, name: str, sm, logs, region: str, *, output: LineCallback | None = None,
                 poll_seconds: float = POLL_SECONDS, stop_wait_seconds: float = STOP_WAIT_SECONDS,
                 sleep: Callable[[float], None] = time.sleep, secrets: list[str] | None = None) -> None:
        self.name = name
        self.region = region
        self.sm = sm
        self.poll_seconds = poll_seconds
        self.stop_wait_seconds = stop_wait_seconds
        self.sleep = sleep
        self._output = output
        self._redact = Redactor(secrets or [])
        self._follower = LogFollower(logs, name)
        self._seen_status: tuple[str | None, str | None] | None = None
        self.description: dict[str, Any] | None = None

    # --- making one ----------------------------------------------------------------------------

    @classmethod
    def submit(cls, spec: SageMakerJobSpec, session, secret_env: dict[str, str], **kwargs: Any) -> SageMakerJobRun:
        """Create the training job (CreateTrainingJob through the SDK) and return its handle."""
        name = submit(spec, session, secret_env)
        kwargs["secrets"] = [*kwargs.get("secrets", []), *secret_env.values()]
        return cls(name, session.client("sagemaker"), session.client("logs"), spec.region, **kwargs)

    @classmethod
    def from_plan(cls, plan: LaunchPlan, **kwargs: Any) -> SageMakerJobRun:
        """Submit a planned SageMaker launch (`plan_launch(...)` for a SageMaker config) and return its handle.

        The plan's secrets (flag keys, secret job variables) are taken from this process's memory, used for
        the submission and the handle's redaction, then forgotten; the handle keeps its signed clients.
        """
        spec = SageMakerJobSpec.model_validate(plan.request)
        try:
            secret_env = job_secret_environment(spec)
            session = aws_credentials.boto_session(spec.credentials, spec.region)
            kwargs["secrets"] = [*kwargs.get("secrets", []), *aws_credentials.secret_values(spec.handle)]
            return cls.submit(spec, session, secret_env, **kwargs)
        finally:
            aws_credentials.forget(spec.handle)

    @classmethod
    def attach(cls, name: str, region: str, credentials: aws_credentials.CredentialSource | None = None,
               **kwargs: Any) -> SageMakerJobRun:
        """A handle on a job that already exists (submitted by another process, say), by name."""
        session = aws_credentials.boto_session(credentials or aws_credentials.CredentialSource(source="environment"), region)
        return cls(name, session.client("sagemaker"), session.client("logs"), region, **kwargs)

    # --- looking at it -------------------------------------------------------------------------

    def emit(self, label: str, line: str) -> None:
        line = self._redact(line)
        if self._output is not None:
            self._output(label, line)
        else:
            self.logger.info("[%s] %s", label, line)

    def describe(self) -> SageMakerJob:
        """DescribeTrainingJob now."""
        self.description = self.sm.describe_training_job(TrainingJobName=self.name)
        environment = self.description.get("Environment") or {}
        self._redact.add(value for key, value in environment.items() if is_secret_name(key) and value not in self._redact)
        return SageMakerJob.from_description(self.description, self.region)

    @property
    def status(self) -> str:
        """The status SageMaker reported last (call `describe()` or `poll()` for a fresh one)."""
        return (self.description or {}).get("TrainingJobStatus") or "Unknown"

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL

    def new_log_lines(self) -> list[tuple[str, str]]:
        """The log lines written since the last call, as (instance label, line)."""
        return self._follower.poll()

    def poll(self) -> SageMakerJob:
        """One round: status and new log lines to the output (a status line only when it changed)."""
        job = self.describe()
        for label, line in self.new_log_lines():
            self.emit(label, line)
        status = (job.status, job.secondary_status)
        if status != self._seen_status:
            self.emit("sagemaker", f"{self.name}: {status[0]} ({status[1]})")
            self._seen_status = status
        return job

    # --- waiting, stopping, the outcome ----------------------------------------------------------

    def wait(self, timeout: float | None = None) -> SageMakerJob:
        """Follow the job until it ends or `timeout` seconds pass (then it is still running: see `finished`)."""
        deadline = time.monotonic() + timeout if timeout is not None else None
        while True:
            job = self.poll()
            if self.finished or (deadline is not None and time.monotonic() >= deadline):
                return job
            self.sleep(self.poll_seconds)

    def stop(self, wait_seconds: float | None = None) -> SageMakerJob | None:
        """StopTrainingJob, then give the job `wait_seconds` (default: `stop_wait_seconds`) to leave InProgress.

        Its last state, if read."""
        self.emit("sagemaker", f"Stopping training job {self.name}")
        stop_job(self.sm, self.name)
        end = time.monotonic() + (self.stop_wait_seconds if wait_seconds is None else wait_seconds)
        job = None
        while time.monotonic() < end:
            job = self.describe()
            if self.finished:
                break
            self.sleep(min(2.0, max(end - time.monotonic(), 0)))
        return job

    def result(self) -> SageMakerJob:
        """The finished job; a LaunchError with SageMaker's FailureReason when it failed or was stopped."""
        job = SageMakerJob.from_description(self.description, self.region) if self.finished else self.describe()
        if job.status not in TERMINAL:
            raise LaunchError(f"Training job {self.name} is still {job.status}: wait for it first (console: {job.console_url}).")
        if job.status != "Completed":
            raise LaunchError(failure_message(job))
        return job

    async def wait_for_completion(self) -> None:
        import anyio

        await anyio.to_thread.run_sync(self.wait)

    async def fetch_result(self) -> SageMakerJob:
        import anyio

        return await anyio.to_thread.run_sync(self.result)

    def __enter__(self) -> SageMakerJobRun:
        return self

    def __exit__(self, kind, error, trace) -> None:  # noqa: ANN001
        if kind is not None and not self.finished:
            with contextlib.suppress(Exception):  # the original exception is the one to report
                self.stop()


def job_secret_environment(spec: SageMakerJobSpec) -> dict[str, str]:
    """The job's secret variables, from this process's memory (plans never hold them)."""
    secret_env = {k: v.get_secret_value() for k, v in aws_credentials.secret_environment(spec.handle).items()}
    missing = [name for name in spec.secret_environment if name not in secret_env]
    if missing:
        raise LaunchError(
            f"The job's secret variables {', '.join(missing)} are not available in this process: secrets are never stored in "
            "plans. Plan and launch in the same process, or give them to the job another way (e.g. AWS Secrets Manager)."
        )
    return secret_env


def failure_message(job: SageMakerJob) -> str:
    return f"training job {job.name} {job.status.lower()}: {job.failure_reason or 'no reason given'} (console: {job.console_url})"


def run_job(
    plan: LaunchPlan,
    *,
    on_line: LineCallback | None = None,
    timeout: float | None = None,
    grace: float = STOP_WAIT_SECONDS,
    flow_run_id: str | None = None,
    task_run_id: str | None = None,
    poll_seconds: float = POLL_SECONDS,
    sleep: Callable[[float], None] = time.sleep,
) -> SageMakerLaunchResult:
    """Submit the plan's job and follow it to the end (or the deadline). Interrupts stop the job and re-raise.

    Returns:
        A SageMakerLaunchResult: exit code 0 for Completed, 1 for Failed or Stopped (FailureReason in
        `error`), 124 at the deadline (the job was stopped). Call `raise_for_failure()` for a LaunchError.
    """
    spec = SageMakerJobSpec.model_validate(plan.request)
    run_dir = make_private_dir(Path(plan.run_dir) if plan.run_dir else new_run_dir("sagemaker"), "run folder")
    launch_id = run_dir.name
    handle = spec.handle
    secret_env = job_secret_environment(spec)
    output = _Output(on_line, run_dir / "launch.log", aws_credentials.secret_values(handle))
    started = time.monotonic()
    job_run: SageMakerJobRun | None = None
    timed_out = False
    try:
        session = aws_credentials.boto_session(spec.credentials, spec.region)
        with sigterm_as_exception():
            output("sagemaker", f"Submitting a training job {spec.base_job_name}-* ({spec.instance_count} x {spec.instance_type}, image {spec.image_uri})")
            job_run = SageMakerJobRun.submit(spec, session, secret_env, output=output, poll_seconds=poll_seconds,
                                             stop_wait_seconds=min(grace, STOP_WAIT_SECONDS), sleep=sleep)
            with job_run:  # an exception from here on (Ctrl-C, SIGTERM, a cancellation) stops the job
                record_job(launch_id, {"job_name": job_run.name, "region": spec.region, "credentials": spec.credentials.model_dump(),
                                       "flow_run_id": flow_run_id, "task_run_id": task_run_id, "started_at": time.time()})
                output("sagemaker", f"Training job {job_run.name} created; console: "
                       f"{SageMakerJob(name=job_run.name, region=spec.region, status='?').console_url}")
                job_run.wait(timeout=timeout - (time.monotonic() - started) if timeout else None)
                if not job_run.finished:
                    timed_out = True
                    job_run.stop()
    finally:
        if job_run is not None:
            forget_job(launch_id)
        aws_credentials.forget(handle)
        output.close()

    job = SageMakerJob.from_description(job_run.description, spec.region)
    name = job_run.name
    if timed_out:
        code, error = TIMEOUT_EXIT_CODE, f"training job {name} was stopped at the deadline ({timeout} s)"
    elif job.status == "Completed":
        code, error = 0, None
    else:
        code, error = 1, failure_message(job)
    if job.model_artifacts and code == 0:
        output_line = f"You can find your model data at: {job.model_artifacts}"
        output.tail.append(output_line)
        if on_line is not None:
            with contextlib.suppress(Exception):
                on_line("sagemaker", output_line)
    return SageMakerLaunchResult(
        launcher="sagemaker", command=f"training job {name}: {plan.command_line()}", exit_code=code, launcher_exit_code=code,
        error=error, duration_s=round(time.monotonic() - started, 3), run_dir=str(run_dir), log_path=str(run_dir / "launch.log"),
        tail=list(output.tail)[-40:], timed_out=timed_out, job=job,
    )
