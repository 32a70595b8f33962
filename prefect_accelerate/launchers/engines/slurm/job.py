"""A Slurm job's lifecycle: submit (sbatch), follow (scontrol/squeue, sacct when accounting exists), stop
(scancel), report.

`SlurmJobRun` is the handle on one batch job (Prefect's `JobRun`), made by `submit(plan)` or
`attach(job_id)`. Its output is the job's output file (in the run folder, on the shared filesystem),
read as it grows: `srun --label` puts the node rank in front of each line and torchrun the local rank,
so each line is labelled `node N rank R`; the batch script's own lines are labelled `slurm`. Under
DeepSpeed's `slurm` launcher srun starts the ranks themselves, so its label is the rank and the node is
the rank divided by the processes per node (srun's block layout, with --ntasks-per-node).

`run_job(plan, ...)` is what `execute()` calls for a Slurm plan. A deadline, Ctrl-C, SIGTERM or a Prefect
cancellation cancels the job (scancel) and waits for Slurm to end it on every node before the exception
goes on; the job id is recorded so the flow's cancellation hook can cancel it too (`cancel_recorded_jobs`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from prefect_accelerate.errors import USAGE_EXIT_CODE, LaunchError
from prefect_accelerate.launchers.plan import LaunchPlan
from prefect_accelerate.secrets import Redactor
from prefect_accelerate.launchers.result import TIMEOUT_EXIT_CODE, LaunchResult, parse_rank_failures, read_error_file
from prefect_accelerate.launchers.state import read_records, remove_record, write_record
from prefect_accelerate.launchers.joblog import emit_job_line, open_run_log

POLL_SECONDS = 0.5
#: how long stop() waits for Slurm to end the job on every node (KillWait plus the step's teardown)
STOP_WAIT_SECONDS = 60.0
TAIL_LINES = 200
SLURM_JOBS = "slurm-jobs"
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING", "STAGE_OUT")
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE")
#: srun --label's "N: " (task id = node rank, one task per node), then torchrun's "[default3]:"
_LABEL = re.compile(r"^\s*(?P<node>\d+): (?:\[(?P<role>[A-Za-z_][\w-]*?)(?P<rank>\d+)\]:)?")
#: pending reasons that mean the job can never start as asked (Slurm keeps it queued regardless)
NEVER_RUNS = frozenset({
    "PartitionNodeLimit", "PartitionConfig", "PartitionTimeLimit", "PartitionDown", "PartitionInactive", "InvalidAccount",
    "InvalidQOS", "AccountNotAllowed", "QOSNotAllowed", "ReqNodeNotAvail", "BadConstraints", "AssocMaxNodesPerJobLimit",
    "AssocMaxWallDurationPerJobLimit", "QOSMaxNodePerJobLimit", "QOSMaxWallDurationPerJobLimit", "MaxNodesPerJob",
})
_SRUN_ERROR = re.compile(r"srun: error: (?P<host>\S+): task (?P<task>\d+): (?P<what>.*)")

LineCallback = Callable[[str, str], None]


class SlurmJob(BaseModel):
    """What Slurm says about a batch job (and, once it ended, which node and rank failed and why)."""

    job_id: str
    state: str
    exit_code: int | None = None
    signal: int | None = None
    reason: str | None = None
    nodes: str | None = None
    output_path: str | None = None
    failed_node: str | None = None
    failed_node_rank: int | None = None
    failed_rank: int | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.state in FINAL


class SlurmLaunchResult(LaunchResult):
    job: SlurmJob | None = None


def _slurm_command(argv: list[str], env: dict[str, str] | None = None, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)


def require_sbatch() -> str:
    path = shutil.which("sbatch")
    if path is None:
        raise LaunchError(
            "`sbatch` was not found on PATH, so the job could not be submitted and nothing was queued. Run "
            "prefect-accelerate on a Slurm login node (or load Slurm's module, e.g. `module load slurm`), or use "
            "--dry-run to see the script.", exit_code=USAGE_EXIT_CODE)
    return path


def parse_fields(text: str) -> dict[str, str]:
    """`scontrol show job -o` output as a dict (values hold no spaces, except Command and a few paths)."""
    fields: dict[str, str] = {}
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep:
            fields[key] = value
    return fields


def write_files(files: dict[str, str]) -> None:
    """The plan's scripts, each written atomically (executable, readable by the owner only)."""
    for path, content in files.items():
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_text(content)
        tmp.chmod(0o700)
        os.replace(tmp, target)


class SlurmJobRun:
    """A handle on one Slurm batch job: status, output, waiting, cancelling, the outcome.

        job = SlurmJobRun.submit(plan_launch(options))      # or SlurmJobRun.attach("1234")
        with job:                                           # an exception in the block cancels the job
            job.wait(timeout=3600)
        print(job.result().state)

    Lines go to `output(label, line)` (else the Prefect run logger) with known secret values replaced by ***.
    """

    def __init__(self, job_id: str, *, output_path: str | None = None, output: LineCallback | None = None,
                 poll_seconds: float = POLL_SECONDS, secrets: list[str] | None = None, run_dir: str | None = None) -> None:
        self.job_id = str(job_id)
        self.name = self.job_id  # the engine protocol's job name (launchers/engines JobHandle)
        self.output_path = output_path
        self.run_dir = run_dir
        self.poll_seconds = poll_seconds
        self._output = output
        self._redact = Redactor(secrets or [])
        self._offset = 0
        self._partial = ""
        self._seen_state: str | None = None
        self.last: SlurmJob | None = None
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.srun_errors: list[tuple[str, int, str]] = []
        #: set by run_job when its deadline cancelled the job
        self.timed_out = False

    # --- making one ----------------------------------------------------------------------------

    @classmethod
    def submit(cls, plan: LaunchPlan, **kwargs) -> SlurmJobRun:  # noqa: ANN003
        """Write the plan's scripts and sbatch them; a refusal is a LaunchError (exit 2) with Slurm's reason."""
        sbatch = require_sbatch()
        write_files(plan.files)
        env = {**os.environ, **plan.env}
        done = _slurm_command([sbatch, *plan.argv[1:]], env=env)
        if done.returncode != 0:
            reason = (done.stderr or done.stdout).strip().replace("\n", " ")
            raise LaunchError(
                f"Slurm refused the job ({plan.argv[-1]}): {reason or 'no reason given'}. Nothing was queued. Check "
                "--slurm_partition, --slurm_account, --slurm_qos, --num_machines (at most the nodes the partition has) and "
                "--slurm_sbatch_args against `sinfo` and `sacctmgr show assoc user=$USER`.", exit_code=USAGE_EXIT_CODE)
        job_id = done.stdout.strip().split(";")[0]
        request = plan.request or {}
        output_path = next((o.split("=", 1)[1] for o in request.get("sbatch_options", []) if o.startswith("--output=")), None)
        kwargs.setdefault("run_dir", plan.run_dir)
        kwargs["secrets"] = [*kwargs.get("secrets", []), *plan.env.values()]
        return cls(job_id, output_path=output_path.replace("%j", job_id) if output_path else None, **kwargs)

    @classmethod
    def attach(cls, job_id: str, **kwargs) -> SlurmJobRun:  # noqa: ANN003
        """A handle on a job that already exists (submitted by another process), by id."""
        job = cls(job_id, **kwargs)
        info = job.describe()
        if info.state == "UNKNOWN":
            raise LaunchError(f"Slurm knows no job {job_id} (scontrol show job {job_id} and sacct found nothing). Check the job id "
                              "with `squeue --me`.", exit_code=USAGE_EXIT_CODE)
        job.output_path = job.output_path or info.output_path
        if job.run_dir is None and job.output_path:
            job.run_dir = str(Path(job.output_path).parent)
        return job

    # --- looking at it -------------------------------------------------------------------------

    def describe(self) -> SlurmJob:
        """The job's state now: scontrol while Slurm remembers the job, sacct after that (when accounting exists)."""
        done = _slurm_command(["scontrol", "show", "job", "-o", self.job_id])
        fields = parse_fields(done.stdout) if done.returncode == 0 else {}
        if fields.get("JobState"):
            code, _, sig = fields.get("ExitCode", "").partition(":")
            job = SlurmJob(job_id=self.job_id, state=fields["JobState"], exit_code=_int(code), signal=_int(sig),
                           reason=None if fields.get("Reason") in (None, "None") else fields["Reason"],
                           nodes=None if fields.get("NodeList") in (None, "(null)") else fields["NodeList"],
                           output_path=fields.get("StdOut"))
        else:
            job = self._from_sacct()
        self.last = job
        return job

    def _from_sacct(self) -> SlurmJob:
        done = _slurm_command(["sacct", "-j", self.job_id, "-X", "-n", "-P", "-o", "State,ExitCode,NodeList,Reason"])
        rows = [line.split("|") for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []
        if not rows:
            return SlurmJob(job_id=self.job_id, state="UNKNOWN")
        state, exit_code, nodes, reason = (rows[0] + ["", "", "", ""])[:4]
        code, _, sig = exit_code.partition(":")
        return SlurmJob(job_id=self.job_id, state=state.split()[0].rstrip("+"), exit_code=_int(code), signal=_int(sig),
                        nodes=nodes or None, reason=None if reason in ("", "None") else reason)

    @property
    def state(self) -> str:
        return self.last.state if self.last else "UNKNOWN"

    @property
    def finished(self) -> bool:
        return self.state in FINAL

    @property
    def status(self) -> str:
        """The engine protocol's status: Slurm's job state as last seen (PENDING, RUNNING, COMPLETED, ...)."""
        return self.state

    def new_log_lines(self) -> list[tuple[str, str]]:
        """The engine protocol's output: (label, line) for each whole line written since the last call, redacted.
        Reads the same output file as `poll`, so use one or the other to follow a job."""
        out = []
        for raw in self.new_lines():
            label, line = self.label(raw)
            out.append((label, self._redact(line)))
        return out

    def emit(self, label: str, line: str) -> None:
        emit_job_line(self._output, self.tail, label, self._redact(line))

    def label(self, line: str) -> tuple[str, str]:
        """(`node N rank R`, text) for a training line; (`node N`, text) for a node's other lines; else `slurm`."""
        match = _LABEL.match(line)
        if match is None:
            srun = _SRUN_ERROR.search(line)
            if srun:
                self.srun_errors.append((srun.group("host"), int(srun.group("task")), srun.group("what")))
            return "slurm", line
        task = int(match.group("node"))
        per_node, tasks_are_ranks = self._layout()
        if tasks_are_ranks:
            return f"node {task // per_node} rank {task}", line[match.end():]
        if match.group("rank") is None:
            return f"node {task}", line[match.end():]
        return f"node {task} rank {task * per_node + int(match.group('rank'))}", line[match.end():]

    def _layout(self) -> tuple[int, bool]:
        """(processes per node, whether srun's task ids are the ranks), from the scripts in the run folder."""
        if not hasattr(self, "_layout_found"):
            per_node, tasks_are_ranks = 1, False
            folder = Path(self.run_dir or "")
            with contextlib.suppress(OSError):
                found = re.search(r"--nproc_per_node (\d+)", (folder / "node.sh").read_text())
                per_node = int(found.group(1)) if found else 1
            if not (folder / "node.sh").exists():
                with contextlib.suppress(OSError):
                    script = (folder / "slurm.sbatch").read_text()
                    tasks_are_ranks = "deepspeed.launcher.runner" in script  # DeepSpeed's own srun starts the ranks
                    found = re.search(r"^#SBATCH --ntasks-per-node=(\d+)", script, re.M)
                    per_node = int(found.group(1)) if found and tasks_are_ranks else per_node
            self._layout_found = (per_node, tasks_are_ranks)
        return self._layout_found

    def new_lines(self) -> list[str]:
        """Whole lines appended to the job's output file since the last call."""
        if not self.output_path:
            return []
        try:
            with open(self.output_path, encoding="utf-8", errors="replace") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
                self._offset = handle.tell()
        except FileNotFoundError:
            return []  # not started yet
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()
        return lines

    def poll(self) -> SlurmJob:
        """One round: state, then new output lines (labelled), then a line when the state changed."""
        job = self.describe()
        for raw in self.new_lines():
            label, line = self.label(raw)
            self.emit(label, line)
        if job.finished and self._partial:
            label, line = self.label(self._partial)
            self._partial = ""
            self.emit(label, line)
        if job.state != self._seen_state:
            reason = f" ({job.reason})" if job.reason else ""
            self.emit("slurm", f"job {self.job_id}: {job.state}{reason}" + (f" on {job.nodes}" if job.nodes and job.state == "RUNNING" else ""))
            self._seen_state = job.state
        return job

    # --- waiting, stopping, the outcome ----------------------------------------------------------

    def wait(self, timeout: float | None = None, *, until: Callable[[SlurmJob], bool] | None = None) -> SlurmJob:
        """Follow the job until it ends, `until(job)` holds, or `timeout` seconds pass."""
        deadline = time.monotonic() + timeout if timeout is not None else None
        while True:
            job = self.poll()
            if job.finished or job.state == "UNKNOWN" or (until is not None and until(job)):
                return job
            if deadline is not None and time.monotonic() >= deadline:
                return job
            time.sleep(self.poll_seconds)

    def stop(self, wait_seconds: float = STOP_WAIT_SECONDS) -> SlurmJob:
        """scancel, then follow the job until Slurm has ended it on every node (it leaves COMPLETING)."""
        self.emit("slurm", f"Cancelling job {self.job_id} (scancel)")
        _slurm_command(["scancel", self.job_id])
        return self.wait(timeout=wait_seconds)

    def result(self) -> SlurmJob:
        """The finished job with, for a failure, the failing node and rank and the script's own error."""
        job = self.last if self.finished else self.describe()
        if not job.finished:
            raise LaunchError(f"Slurm job {self.job_id} is still {job.state}: wait for it first.")
        update: dict = {}
        if self.srun_errors:
            # the task that exited on its own failed first; the others were killed by srun --kill-on-bad-exit after it
            host, task, what = next((e for e in self.srun_errors if e[2].startswith("Exited")), self.srun_errors[0])
            per_node, tasks_are_ranks = self._layout()
            update |= {"failed_node": host, "failed_node_rank": task // per_node if tasks_are_ranks else task}
            own_code = re.match(r"Exited with exit code (\d+)", what)
            if tasks_are_ranks:
                update["failed_rank"] = task
                if own_code and job.state != "COMPLETED":
                    # srun exits with the highest code of its tasks: the peers it terminated (143) would hide the rank's own
                    update["exit_code"] = int(own_code.group(1))
        failures, _ = parse_rank_failures([_LABEL.sub("", line) for line in self.tail])
        if failures:
            update["failed_rank"] = failures[0].rank
        if job.state != "COMPLETED" and self.run_dir:
            # only the failing node's file explains the failure: a peer's says it was stopped after it (SIGTERM)
            known = update.get("failed_node_rank")
            pattern = f"error-node-{known}.json" if known is not None else "error-node-*.json"
            for path in sorted(Path(self.run_dir).glob(pattern)):
                message, _ = read_error_file(path)
                if message:
                    update["error"] = self._redact(message.strip().splitlines()[-1])
                    update.setdefault("failed_node_rank", int(path.stem.rsplit("-", 1)[-1]))
                    break
        if failures and job.state != "COMPLETED":
            if failures[0].exit_code > 0:
                update["exit_code"] = failures[0].exit_code  # the worker's own code (srun reports torchrun's 1 or a kill's 137)
            elif "error" not in update:
                update["error"] = f"the process was killed by {_signal_name(-failures[0].exit_code)}"
        self.last = job.model_copy(update=update)
        return self.last

    async def wait_for_completion(self) -> None:
        import anyio

        await anyio.to_thread.run_sync(self.wait)

    async def fetch_result(self) -> SlurmJob:
        import anyio

        return await anyio.to_thread.run_sync(self.result)

    def __enter__(self) -> SlurmJobRun:
        return self

    def __exit__(self, kind, error, trace) -> None:  # noqa: ANN001
        if kind is not None and not self.finished:
            with contextlib.suppress(Exception):  # the original exception is the one to report
                self.stop()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text not in (None, "") else None
    except ValueError:
        return None


def cancel_recorded_jobs(flow_run_id: str | None = None) -> list[str]:
    """Hook helper: scancel the Slurm jobs recorded for `flow_run_id` (all when None). Idempotent."""
    cancelled = []
    for data in read_records(SLURM_JOBS, flow_run_id, this_host=False):
        with contextlib.suppress(Exception):
            _slurm_command(["scancel", str(data["job_id"])])
            cancelled.append(str(data["job_id"]))
        with contextlib.suppress(FileNotFoundError):
            Path(data["_path"]).unlink()
    return cancelled


def failure_text(job: SlurmJob) -> str | None:
    if job.state == "COMPLETED" and not job.exit_code:
        return None
    where = ""
    if job.failed_node_rank is not None or job.failed_rank is not None:
        parts = [f"node {job.failed_node_rank}" + (f" ({job.failed_node})" if job.failed_node else "")] if job.failed_node_rank is not None else []
        parts += [f"rank {job.failed_rank}"] if job.failed_rank is not None else []
        where = " on " + ", ".join(parts)
    text = f"Slurm job {job.job_id} ended {job.state} with exit code {job.exit_code}{where}"
    return text + (f": {job.error}" if job.error else "")


def _follow(job_run: SlurmJobRun, output: LineCallback, timeout: float | None, grace: float, pending_timeout: float | None,
            started: float) -> None:
    """Wait for the job: refuse one that can never start or stays pending too long, cancel it at the deadline."""
    job_run.timed_out = False
    with job_run:  # an exception in here (Ctrl-C, SIGTERM, a cancellation) cancels the job
        output("slurm", f"Submitted batch job {job_run.job_id}; output in {job_run.output_path}")
        job = job_run.wait(timeout=pending_timeout, until=lambda j: j.state != "PENDING" or (j.reason or "").split(",")[0] in NEVER_RUNS)
        if job.state == "PENDING" and (job.reason or "").split(",")[0] in NEVER_RUNS:
            job_run.stop()
            raise LaunchError(
                f"Slurm accepted job {job_run.job_id} but can never start it as asked (Slurm's reason: {job.reason}), so it "
                "was cancelled and nothing is left queued. Ask for at most the nodes, time and GPUs the partition allows "
                "(`sinfo -p PARTITION`, `scontrol show partition`), or another --slurm_partition/--slurm_account/--slurm_qos.",
                exit_code=USAGE_EXIT_CODE)
        if pending_timeout:
            if job.state == "PENDING":
                job_run.stop()
                raise LaunchError(
                    f"Slurm job {job_run.job_id} was still pending after {pending_timeout:g} s (Slurm's reason: "
                    f"{job.reason or 'none given'}), so it was cancelled and nothing is left queued. Ask for fewer or "
                    "other resources, another partition, or a longer --slurm_pending_timeout.", exit_code=USAGE_EXIT_CODE)
        remaining = None if timeout is None else max(timeout - (time.monotonic() - started), 0.0)
        job_run.wait(timeout=remaining)
        if not job_run.finished:
            job_run.timed_out = True
            job_run.stop(wait_seconds=max(grace, STOP_WAIT_SECONDS))


def run_job(plan: LaunchPlan, *, on_line: LineCallback | None = None, timeout: float | None = None,
            grace: float = STOP_WAIT_SECONDS, flow_run_id: str | None = None, task_run_id: str | None = None,
            poll_seconds: float = POLL_SECONDS) -> SlurmLaunchResult:
    """Submit the plan's job and follow it to the end (or the deadline). Interrupts cancel the job and re-raise.

    Returns:
        A SlurmLaunchResult: the training's exit code (the failing worker's when torchrun names it), 124 when the
        deadline cancelled the job, 1 for a job Slurm ended (CANCELLED, TIMEOUT, NODE_FAIL) without one.
    Raises:
        LaunchError (exit 2): no sbatch, Slurm refused the job, or it stayed pending past --slurm_pending_timeout.
    """
    from prefect_accelerate.signals import sigterm_as_exception


    log_path = Path(plan.run_dir or ".", "launch.log")
    log = open_run_log(log_path, plan.run_dir)  # closed below

    def output(label: str, line: str) -> None:
        log.write(f"[{label}] {line}\n")
        log.flush()
        if on_line is not None:
            on_line(label, line)

    started = time.monotonic()
    pending_timeout = (plan.request or {}).get("pending_timeout")
    timed_out = False
    job_run: SlurmJobRun | None = None
    try:
        with sigterm_as_exception():
            job_run = SlurmJobRun.submit(plan, output=output, poll_seconds=poll_seconds)
            record = f"{Path(plan.run_dir or '.').name}-{job_run.job_id}"
            # the record outlives this process only if it dies without running the finally below (SIGKILL): then the
            # flow's cancellation hook still finds the job to cancel
            write_record(SLURM_JOBS, record, {"job_id": job_run.job_id, "flow_run_id": flow_run_id, "task_run_id": task_run_id})
            try:
                _follow(job_run, output, timeout, grace, pending_timeout, started)
            finally:
                remove_record(SLURM_JOBS, record)
            timed_out = job_run.timed_out
    finally:
        log.close()
    job = job_run.result()
    message = failure_text(job)
    if timed_out:
        code, message = TIMEOUT_EXIT_CODE, f"Slurm job {job.job_id} was cancelled at the deadline ({timeout} s)"
    elif job.state == "COMPLETED" and not job.exit_code:
        code = 0
    else:
        code = job.exit_code if job.exit_code else 1
    failed = []
    if job.failed_rank is not None and code not in (0, TIMEOUT_EXIT_CODE):
        from prefect_accelerate.launchers.result import RankFailure

        failed = [RankFailure(rank=job.failed_rank, exit_code=code)]
    return SlurmLaunchResult(
        launcher="slurm", command=f"Slurm job {job.job_id}: {plan.command_line()}", exit_code=code,
        launcher_exit_code=job.exit_code, failed_ranks=failed, root_cause_rank=job.failed_rank, error=message,
        duration_s=round(time.monotonic() - started, 3), run_dir=plan.run_dir, log_path=str(log_path),
        tail=list(job_run.tail)[-40:], timed_out=timed_out, job=job,
    )
