"""What a pipeline is asked to do, and what it reports. Pydantic, so deployments get typed UI forms."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from prefect_accelerate.launchers.result import LaunchResult
from prefect_accelerate.memory.models import Library, Optimizer

#: every step of a pipeline, in order (the DAG: config -> env || memory -> memory-fit -> deepspeed-check
#: -> install-test -> launch)
STEP_NAMES: tuple[str, ...] = ("config", "env", "memory", "memory-fit", "deepspeed-check", "install-test", "launch")
PREFLIGHT_STEPS: tuple[str, ...] = STEP_NAMES[:-1]


class MemorySettings(BaseModel):
    """How to size the model for the memory-fit gate (the layout itself comes from the launch options)."""

    model_config = ConfigDict(extra="forbid")

    optimizer: Optimizer = "adamw"
    batch_size: int = Field(1, ge=1, description="Per-device batch size, for activations (transformers models).")
    seq_len: int | None = Field(None, ge=1, description="Sequence length, for activations (transformers models).")
    gradient_checkpointing: bool = False
    device_memory: str | None = Field(None, description="Memory of one device, e.g. 80GiB; detected when empty.")
    library_name: Library | None = None
    trust_remote_code: bool = False
    measure: bool = Field(False, description="Also run real training steps of the model with random weights (memory/probe.py); "
                                             "the gate then rests on the measured peak.")


class PipelineRequest(BaseModel):
    """A launch and the preflight checks that gate it.

    `launch_flags` are `accelerate launch` flags by their destination names (`num_processes`, `cpu`,
    `mixed_precision`, `use_deepspeed`, ...); they win over the config file exactly as on the command line.
    """

    model_config = ConfigDict(extra="forbid")

    script: str = Field(description="The training script (or module with launch_flags.module).")
    script_args: list[str] = Field(default_factory=list)
    config_file: str | None = Field(None, description="Accelerate config file; the default config when empty.")
    launch_flags: dict[str, Any] = Field(default_factory=dict)
    model: str | None = Field(None, description="Model to size for the memory gate: a folder with config.json, a Hub id in the HF cache, or a timm name.")
    memory: MemorySettings = Field(default_factory=MemorySettings)
    run_install_test: bool = Field(True, description="Run the distributed self-test with the same launcher first.")
    require_approval: bool = Field(False, description="Pause before the launch until someone approves it in the Prefect UI.")
    force: list[str] = Field(default_factory=list, description="Steps to re-run even if cached; ['all'] for every step.")
    timeout: float | None = Field(None, description="Deadline for the training launch, in seconds.")
    cwd: str | None = Field(None, description="Working directory of the launch (default: the flow's).")

    def forced(self, step: str) -> bool:
        return "all" in self.force or step in self.force


StepStatus = Literal["ran", "cached", "failed", "skipped", "would run", "would use cache", "not needed"]


class StepOutcome(BaseModel):
    """One row of the summary table."""

    step: str
    status: StepStatus
    duration_s: float | None = None
    reason: str = ""


class PreflightReport(BaseModel):
    """What the preflight found; `ok` gates the launch."""

    ok: bool
    steps: list[StepOutcome] = Field(default_factory=list)
    failed_step: str | None = None
    message: str = ""
    #: what the CLI exits with when a step failed: 2 for bad input (a missing config file, a bad flag), else 1
    exit_code: int = 0
    results: dict[str, Any] = Field(default_factory=dict, description="Each step's result (pydantic models as data).")

    def step(self, name: str) -> StepOutcome | None:
        return next((s for s in self.steps if s.step == name), None)


class PipelineResult(BaseModel):
    preflight: PreflightReport
    launched: bool
    approved: bool | None = None
    launch: LaunchResult | None = None


class ValidationRequest(BaseModel):
    """The scheduled validation run: preflight over many config files."""

    model_config = ConfigDict(extra="forbid")

    configs: list[str] = Field(description="Config files, folders (every *.yaml / *.yml / *.json in them) or glob patterns.")
    script: str | None = Field(None, description="A script to plan the launch for (default: the bundled self-test).")
    launch_flags: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None
    memory: MemorySettings = Field(default_factory=MemorySettings)
    run_install_test: bool = True
    max_concurrency: int = Field(2, ge=1, description="How many configs are validated at once.")
    force: list[str] = Field(default_factory=list)


class ConfigValidation(BaseModel):
    config_file: str
    ok: bool
    failed_step: str | None = None
    message: str = ""
    steps: list[StepOutcome] = Field(default_factory=list)


class ValidationReport(BaseModel):
    ok: bool
    configs: list[ConfigValidation] = Field(default_factory=list)
