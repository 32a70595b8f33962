"""The engines: one module or folder each, all meeting one small protocol, all named in one table.

An engine does two things with the same vocabulary (options -> plan -> run -> result):

- `plan(options, host, *, cwd, run_dir) -> LaunchPlan`: pure. It reads the merged LaunchOptions and a
  HostProbe, starts nothing, and returns a frozen plan that `--dry-run` prints and golden files pin.
- carrying a plan out. A local engine's plan is a command on this machine, and every local plan runs
  through the same supervisor (launchers/process.py `run_plan`), so such an engine has nothing more to
  write. A remote engine (SageMaker, Slurm, Kubernetes) names its own `run(plan, **how) -> LaunchResult` (submit,
  follow the job to its end, report), `submit(plan) -> JobHandle`, a handle on the job with status, logs,
  stop and result (`SageMakerJobRun`, `SlurmJobRun`, `KubernetesJobRun`), and `stop_recorded(flow_run_id)`, which stops the
  jobs a cancelled or crashed flow run left behind.

ENGINES is the table. `choose_launcher` (launchers/__init__.py) answers with a route, a row's name or
one of its `routes`; `plan_launch` plans with that row and `execute` runs remote plans with it. Each
row names its functions as "module:attribute" and imports them only when asked, so planning a local
launch never imports an engine it does not use (nor Prefect, which the SageMaker handle needs).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from prefect_accelerate.launchers.host import HostProbe
    from prefect_accelerate.launchers.plan import LaunchPlan
    from prefect_accelerate.launchers.result import LaunchResult


class PlanFunction(Protocol):
    """Options and host in, a LaunchPlan out; no side effects (raise UsageError, ConfigError, LaunchError)."""

    def __call__(self, options: Any, host: HostProbe, *, cwd: str, run_dir: str | None) -> LaunchPlan: ...


class RunFunction(Protocol):
    """Carry a plan out to its end (or `timeout`); interrupts stop what was started and re-raise."""

    def __call__(self, plan: LaunchPlan, *, on_line: Callable[[str, str], None] | None = None, timeout: float | None = None,
                 grace: float = ..., flow_run_id: str | None = None, task_run_id: str | None = None) -> LaunchResult: ...


class JobHandle(Protocol):
    """A remote engine's handle on one submitted job."""

    name: str

    @property
    def status(self) -> str: ...

    @property
    def finished(self) -> bool: ...

    def new_log_lines(self) -> list[tuple[str, str]]:
        """(label, line) pairs written since the last call."""

    def wait(self, timeout: float | None = None) -> Any:
        """Follow the job until it ends or `timeout` seconds pass."""

    def stop(self) -> Any:
        """Ask the job to stop."""

    def result(self) -> Any:
        """The finished job; a LaunchError when it failed or was stopped."""


@dataclass(frozen=True)
class Engine:
    """One row of the table: the engine's name (also the `launcher` of its remote plans) and where its parts live."""

    name: str
    #: "module:function" meeting PlanFunction
    plan: str
    #: remote engines only: "module:function" meeting RunFunction
    run: str | None = None
    #: remote engines only: "module:callable" taking a plan and returning a JobHandle
    submit: str | None = None
    #: other answers of `choose_launcher` this engine serves
    routes: tuple[str, ...] = ()
    #: remote engines only: "module:function" taking a flow run id, stopping the jobs that run's launches
    #: recorded and returning their names (the flow's on_cancellation/on_crashed hook calls it)
    stop_recorded: str | None = None
    #: what one of its jobs is called in messages ("SageMaker job")
    job_noun: str = "job"
    #: remote engines whose plan is pure but whose submission needs a client library: (module, extra, purpose),
    #: checked before anything is printed or started (`require_client`)
    client: tuple[str, str, str] | None = None

    @property
    def remote(self) -> bool:
        return self.run is not None

    def planner(self) -> PlanFunction:
        return _load(self.plan)

    def runner(self) -> RunFunction:
        """The engine's own `run` for a remote engine, else the local process supervisor."""
        return _load(self.run or _LOCAL_RUN)

    def submitter(self) -> Callable[..., JobHandle] | None:
        return _load(self.submit) if self.submit else None

    def stopper(self) -> Callable[[str], list[str]] | None:
        return _load(self.stop_recorded) if self.stop_recorded else None


def _load(reference: str) -> Any:
    module, _, attribute = reference.partition(":")
    value: Any = importlib.import_module(module)
    for name in attribute.split("."):
        value = getattr(value, name)
    return value


#: every local plan, whatever its engine, runs as a supervised process tree
_LOCAL_RUN = "prefect_accelerate.launchers.process:run_plan"

#: every engine, in the order `choose_launcher` considers them
ENGINES: dict[str, Engine] = {
    engine.name: engine
    for engine in (
        Engine("slurm", "prefect_accelerate.launchers.engines.slurm.plan:plan",
               run="prefect_accelerate.launchers.engines.slurm.job:run_job",
               submit="prefect_accelerate.launchers.engines.slurm.job:SlurmJobRun.submit",
               stop_recorded="prefect_accelerate.launchers.engines.slurm.job:cancel_recorded_jobs", job_noun="Slurm job"),
        Engine("kubernetes", "prefect_accelerate.launchers.engines.kubernetes.plan:plan",
               run="prefect_accelerate.launchers.engines.kubernetes.job:run_job",
               submit="prefect_accelerate.launchers.engines.kubernetes.job:KubernetesJobRun.submit",
               stop_recorded="prefect_accelerate.launchers.engines.kubernetes.job:delete_recorded_jobs", job_noun="Kubernetes job",
               client=("kubernetes", "kubernetes", "Submitting a training job to Kubernetes")),
        Engine("deepspeed", "prefect_accelerate.launchers.engines.deepspeed.plan:plan"),
        Engine("torchrun", "prefect_accelerate.launchers.engines.torchrun:plan", routes=("torchrun-cpu",)),
        Engine("tpu", "prefect_accelerate.launchers.engines.tpu.plan:plan"),
        Engine("sagemaker", "prefect_accelerate.launchers.engines.sagemaker.plan:plan",
               run="prefect_accelerate.launchers.engines.sagemaker.job:run_job",
               submit="prefect_accelerate.launchers.engines.sagemaker.job:SageMakerJobRun.from_plan",
               stop_recorded="prefect_accelerate.launchers.engines.sagemaker.job:stop_recorded_jobs", job_noun="SageMaker job"),
        Engine("simple", "prefect_accelerate.launchers.engines.simple:plan"),
    )
}


def engine_for_route(route: str) -> Engine:
    """The engine that serves one of `choose_launcher`'s answers."""
    return next(engine for engine in ENGINES.values() if route == engine.name or route in engine.routes)


def runner_for(plan: LaunchPlan) -> RunFunction:
    """What carries this plan out: its remote engine's `run`, or the local process supervisor."""
    engine = ENGINES.get(plan.launcher)  # local plans carry finer labels too (mpirun, tpu-pod, deepspeed-pdsh)
    return engine.runner() if engine is not None else _load(_LOCAL_RUN)


def require_client(plan: LaunchPlan) -> None:
    """A DependencyError naming the extra when the plan's engine cannot submit it here (its client is missing)."""
    import importlib.util

    from prefect_accelerate.errors import DependencyError

    engine = ENGINES.get(plan.launcher)
    if engine is not None and engine.client is not None and importlib.util.find_spec(engine.client[0]) is None:
        raise DependencyError.missing(*engine.client)


__all__ = ["ENGINES", "Engine", "JobHandle", "PlanFunction", "RunFunction", "engine_for_route", "require_client", "runner_for"]
