"""The preflight DAG for one request: which steps run, what each reads, its cache key, and pictures of it.

`build_graph` is pure apart from reading files and package metadata: `prefect-accelerate plan` calls it
to print the DAG (Mermaid or DOT) and, for each step, whether it would run or come from the cache and
why. The pipeline flow uses the same keys as its Prefect cache keys.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from prefect_accelerate.config.model import as_bool
from prefect_accelerate.errors import PrefectAccelerateError
from prefect_accelerate.pipeline import index
from prefect_accelerate.pipeline.keys import digest, environment_fingerprint, file_digest, step_key
from prefect_accelerate.pipeline.models import STEP_NAMES, PipelineRequest

#: the DAG as layers: every step waits for the steps of the layer before it that are part of the run
#: (config -> env || memory -> memory-fit -> deepspeed-check -> install-test -> launch); a step that is not
#: needed is left out and its dependents wait for the layer before it instead
LAYERS: tuple[tuple[str, ...], ...] = (("config",), ("env", "memory"), ("memory-fit",), ("deepspeed-check",), ("install-test",), ("launch",))


def upstream(name: str, enabled) -> tuple[str, ...]:
    """The steps `name` waits for when only the steps in `enabled` take part."""
    layer = next(i for i, names in enumerate(LAYERS) if name in names)
    for earlier in reversed(LAYERS[:layer]):
        present = tuple(step for step in earlier if step in enabled)
        if present:
            return present
    return ()


#: step -> the steps it waits for when every step takes part
DEPENDS_ON: dict[str, tuple[str, ...]] = {name: upstream(name, STEP_NAMES) for layer in LAYERS for name in layer}

DESCRIPTIONS = {
    "config": "load, migrate in memory and validate the config with the launch flags",
    "env": "probe this machine (versions, accelerators, engines)",
    "memory": "size the model on the meta device for this layout",
    "memory-fit": "check the estimate fits one device, with headroom",
    "deepspeed-check": "DeepSpeed importable, its backend, ZeRO model-state memory",
    "install-test": "distributed self-test through the same launcher and options",
    "launch": "the training launch (never cached)",
}

#: option fields that are bookkeeping, not launch settings (left out of the install-test key)
_NOT_SETTINGS = {"training_script", "training_script_args", "given", "notes", "defaults_warning", "run_dir", "timeout",
                 "grace_period", "config_path", "config_source", "aws_access_key_id", "aws_secret_access_key"}


class StepPlan(BaseModel):
    name: str
    enabled: bool
    depends_on: tuple[str, ...]
    description: str
    key: str | None = None
    inputs: dict[str, str] = Field(default_factory=dict)
    #: "would run" / "would use cache" / "not needed" and why
    status: str = "would run"
    reason: str = ""


class PipelineGraph(BaseModel):
    pipeline_id: str
    steps: list[StepPlan]
    launch_plan: dict[str, Any] | None = None
    error: str | None = None

    def step(self, name: str) -> StepPlan:
        return next(s for s in self.steps if s.name == name)

    def enabled(self) -> list[StepPlan]:
        return [s for s in self.steps if s.enabled]


def pipeline_id(request: PipelineRequest) -> str:
    config = str(Path(request.config_file).expanduser().resolve()) if request.config_file else "default-config"
    return digest({"config": config, "script": str(Path(request.script).expanduser().resolve())})


def launch_options(request: PipelineRequest, *, host=None):
    from prefect_accelerate.launchers.options import build_launch_options

    flags = dict(request.launch_flags)
    if request.timeout is not None:
        flags["timeout"] = request.timeout
    return build_launch_options(request.script, request.script_args, config_file=request.config_file, host=host, **flags)


def deepspeed_json_path(request: PipelineRequest, options) -> str | None:
    """The DeepSpeed JSON config the launch names, relative to the pipeline's working directory; None without one."""
    if not options.deepspeed_config_file:
        return None
    return os.path.join(request.cwd or os.getcwd(), str(options.deepspeed_config_file))


def estimate_options(request: PipelineRequest, options):
    """The memory layout this launch will use: strategy, processes, precision, offload."""
    from prefect_accelerate.memory.models import EstimateOptions
    from prefect_accelerate.memory.strategies import DS_JSON_OPTIONS

    strategy, offload, zero = "ddp", "none", {}
    if options.use_deepspeed:
        from prefect_accelerate.launchers.engines.deepspeed.check import settings_from_options
        from prefect_accelerate.memory.strategies import ZERO_STAGE_STRATEGY, deepspeed_json_settings, offload_from_devices

        settings = settings_from_options(options, cwd=request.cwd)
        strategy = ZERO_STAGE_STRATEGY[int(settings.get("zero_stage") or 0)]
        offload = offload_from_devices(settings.get("offload_param_device"), settings.get("offload_optimizer_device"))
        if options.deepspeed_config_file:
            try:
                zero = deepspeed_json_settings(deepspeed_json_path(request, options))
            except PrefectAccelerateError:
                zero = {}  # an unreadable file is the deepspeed-check step's finding, with its own message
    elif options.use_fsdp:
        if str(options.fsdp_version).strip() == "2":
            strategy = "fsdp_full_shard" if as_bool(options.fsdp_reshard_after_forward) else "fsdp_shard_grad_op"
        else:
            sharding = str(options.fsdp_sharding_strategy).upper()
            strategy = {"FULL_SHARD": "fsdp_full_shard", "SHARD_GRAD_OP": "fsdp_shard_grad_op", "HYBRID_SHARD": "fsdp_hybrid_shard",
                        "HYBRID_SHARD_ZERO2": "fsdp_hybrid_shard", "NO_SHARD": "ddp", "1": "fsdp_full_shard", "2": "fsdp_shard_grad_op"}.get(sharding, "fsdp_full_shard")
        if as_bool(options.fsdp_offload_params):
            offload = "optimizer+params"
    precision = str(options.mixed_precision).lower()
    memory = request.memory
    return EstimateOptions(
        library_name=memory.library_name, trust_remote_code=memory.trust_remote_code, strategy=strategy,
        num_processes=int(options.num_processes), num_machines=int(options.num_machines), offload=offload,
        optimizer=memory.optimizer, mixed_precision="bf16" if precision == "fp8" else precision,
        gradient_checkpointing=memory.gradient_checkpointing, batch_size=memory.batch_size, seq_len=memory.seq_len,
        **{name: zero[name] for name in DS_JSON_OPTIONS if name in zero},
    )


def _model_digest(request: PipelineRequest) -> str:
    if not request.model:
        return "none"
    try:
        from prefect_accelerate.memory.resolve import resolve_model

        return resolve_model(request.model, request.memory.library_name).config_sha256[:16]
    except PrefectAccelerateError:
        return "unresolvable:" + request.model


def _device_digest(request: PipelineRequest, fingerprint: dict[str, str]) -> str:
    if request.memory.device_memory:
        return request.memory.device_memory
    if fingerprint["accelerator"].startswith("cpu"):
        import psutil

        return f"cpu-ram:{psutil.virtual_memory().total}"
    return f"auto:{fingerprint['accelerator']}:{fingerprint['gpus']}"


def settings_digest(options) -> str:
    data = options.model_dump(mode="json", exclude=_NOT_SETTINGS)
    return digest(data)


def build_graph(request: PipelineRequest, *, host=None, with_status: bool = True) -> PipelineGraph:
    """The DAG for `request`: enabled steps, inputs, keys, and (with_status) cached-or-run and why."""
    pid = pipeline_id(request)
    fingerprint = environment_fingerprint()
    env_digest = digest(fingerprint)
    config_path = request.config_file
    if config_path is None:
        from prefect_accelerate.config.paths import find_default_config

        found = find_default_config()
        config_path = str(found.path) if found else None
    config_inputs = {"config file": file_digest(config_path), "launch flags": digest(request.launch_flags), "script": request.script}
    steps: dict[str, StepPlan] = {
        name: StepPlan(name=name, enabled=True, depends_on=DEPENDS_ON[name], description=DESCRIPTIONS[name]) for name in STEP_NAMES
    }
    steps["config"].inputs = config_inputs
    error = None
    launch_plan = None
    try:
        options = launch_options(request, host=host)
    except PrefectAccelerateError as failure:
        options, error = None, failure.message
    steps["env"].inputs = {"environment": env_digest}
    has_model = request.model is not None
    uses_deepspeed = bool(options is not None and options.use_deepspeed)
    for name, wanted in (("memory", has_model), ("memory-fit", has_model), ("deepspeed-check", uses_deepspeed), ("install-test", request.run_install_test)):
        if not wanted:
            steps[name].enabled = False
            steps[name].status = "not needed"
            steps[name].reason = {
                "memory": "no model given", "memory-fit": "no model given",
                "deepspeed-check": "the launch does not use DeepSpeed", "install-test": "run_install_test is off",
            }[name]
    enabled = {name for name, step in steps.items() if step.enabled}
    for step in steps.values():
        step.depends_on = upstream(step.name, enabled) if step.enabled else ()
    if options is not None:
        model = _model_digest(request)
        if has_model:
            layout = estimate_options(request, options)
            # the libraries that build the model on the meta device: an upgrade can change the count
            libraries = digest({name: fingerprint.get(name, "") for name in ("torch", "transformers", "timm")})
            steps["memory"].inputs = {"model config": model, "layout": digest(layout.model_dump(mode="json")),
                                      "model libraries": libraries}
            steps["memory-fit"].inputs = {"memory": "", "device memory": _device_digest(request, fingerprint)}
            if request.memory.measure:  # a measured gate is a different answer than an estimated one
                steps["memory-fit"].inputs["measured"] = "real training steps (--measure_memory)"
        if uses_deepspeed:
            from prefect_accelerate.launchers.engines.deepspeed.check import settings_from_options

            settings = settings_from_options(options, cwd=request.cwd)
            steps["deepspeed-check"].inputs = {
                "deepspeed settings": digest(settings),
                "deepspeed json": file_digest(Path(path) if (path := deepspeed_json_path(request, options)) else None),
                "environment": env_digest, "model config": model,
            }
        steps["install-test"].inputs = {"launch settings": settings_digest(options), "config file": config_inputs["config file"], "environment": env_digest}
        steps["launch"].inputs = {"script": file_digest(Path(request.cwd or ".") / request.script) if not options.module else request.script}
        try:
            from prefect_accelerate.launchers import plan_launch

            launch_plan = plan_launch(options, host, cwd=request.cwd).to_json_dict()
        except PrefectAccelerateError as failure:
            error = failure.message
    for name in STEP_NAMES:
        step = steps[name]
        if not step.enabled or name == "launch":
            continue
        if name == "memory-fit" and "memory" in steps and steps["memory"].key:
            step.inputs["memory"] = steps["memory"].key
        if step.inputs:
            step.key = step_key(name, step.inputs)
    if with_status:
        _explain(request, pid, steps, error, fingerprint)
    return PipelineGraph(pipeline_id=pid, steps=[steps[n] for n in STEP_NAMES], launch_plan=launch_plan, error=error)


#: the fingerprint facts each environment-derived input is made of (None: all of them)
_FACTS_OF_INPUT: dict[str, tuple[str, ...] | None] = {"environment": None, "model libraries": ("torch", "transformers", "timm")}


def _what_changed(name: str, before: dict[str, Any] | None, now: dict[str, str]) -> str:
    """The reason "<name> changed", followed, for an input derived from the environment fingerprint, by which facts moved and how."""
    if name not in _FACTS_OF_INPUT or not isinstance(before, dict):
        return f"{name} changed"  # a file or settings digest, or a record from before the facts were kept
    names = _FACTS_OF_INPUT[name] or sorted(set(now) | set(before))
    moved = [f"{fact} {before.get(fact, '-')} -> {now.get(fact, '-')}" for fact in names if str(before.get(fact, "-")) != str(now.get(fact, "-"))]
    return f"{name} changed ({', '.join(moved)})" if moved else f"{name} changed"


def _explain(request: PipelineRequest, pid: str, steps: dict[str, StepPlan], error: str | None,
             fingerprint: dict[str, str]) -> None:
    for name in STEP_NAMES:
        step = steps[name]
        if not step.enabled:
            continue
        if name == "launch":
            step.status, step.reason = "would run", "a training launch is never cached"
            continue
        if error is not None and name == "config":
            step.status, step.reason = "would run", f"and fail: {error}"
            continue
        if request.forced(name):
            step.status, step.reason = "would run", "forced (--force)"
            continue
        if step.key and index.has_key(step.key):
            step.status, step.reason = "would use cache", "inputs unchanged since the last successful run"
            continue
        last = index.last_record(pid, name)
        if last is None:
            step.status, step.reason = "would run", "no earlier run of this pipeline"
        else:
            changed = [_what_changed(k, last.get("environment"), fingerprint)
                       for k, v in step.inputs.items() if last.get("inputs", {}).get(k) != v]
            step.status = "would run"
            step.reason = ", ".join(changed) if changed else "no cached result for these inputs"


# --------------------------------------------------------------------------------------------------
# rendering (Prefect's flow.visualize cannot draw submitted tasks; ours draws the plan)

_STYLE = {"would use cache": "cached", "cached": "cached", "would run": "run", "ran": "run", "failed": "failed",
          "skipped": "skipped", "not needed": "skipped"}


def to_mermaid(graph: PipelineGraph) -> str:
    lines = ["flowchart LR"]
    for step in graph.steps:
        node = step.name.replace("-", "_")
        lines.append(f'    {node}["{step.name}<br/>{step.status}"]:::{_STYLE.get(step.status, "run")}')
    for step in graph.steps:
        for parent in step.depends_on:
            lines.append(f"    {parent.replace('-', '_')} --> {step.name.replace('-', '_')}")
    lines += [
        "    classDef cached fill:#d9f2d9,stroke:#2e7d32",
        "    classDef run fill:#fff3cd,stroke:#b8860b",
        "    classDef failed fill:#f8d7da,stroke:#a71d2a",
        "    classDef skipped fill:#eeeeee,stroke:#999999,color:#777777",
    ]
    return "\n".join(lines)


def to_dot(graph: PipelineGraph) -> str:
    colors = {"cached": "#d9f2d9", "run": "#fff3cd", "failed": "#f8d7da", "skipped": "#eeeeee"}
    lines = ["digraph preflight {", "  rankdir=LR;", '  node [shape=box, style="rounded,filled"];']
    for step in graph.steps:
        style = _STYLE.get(step.status, "run")
        lines.append(f'  "{step.name}" [label="{step.name}\\n{step.status}", fillcolor="{colors[style]}"];')
    for step in graph.steps:
        for parent in step.depends_on:
            lines.append(f'  "{parent}" -> "{step.name}";')
    lines.append("}")
    return "\n".join(lines)


def plan_rows(graph: PipelineGraph) -> list[dict[str, str]]:
    """The plan as rows for a table artifact: step, what it waits for, would run / use cache / not needed, why."""
    return [{"step": s.name, "after": ", ".join(s.depends_on) or "-", "status": s.status, "why": s.reason, "what": s.description}
            for s in graph.steps]


def to_table(graph: PipelineGraph) -> str:
    width = max(len(s.name) for s in graph.steps)
    status_width = max(len(s.status) for s in graph.steps)
    lines = [f"{'step'.ljust(width)}  {'status'.ljust(status_width)}  why", f"{'-' * width}  {'-' * status_width}  ---"]
    for step in graph.steps:
        lines.append(f"{step.name.ljust(width)}  {step.status.ljust(status_width)}  {step.reason}")
    return "\n".join(lines)
