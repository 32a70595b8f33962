"""SageMaker launches (reference §4.3.5): a SageMakerConfig (or SageMaker flags) becomes a training job.

`plan` is pure: it turns the options into a `SageMakerJobSpec` (the plan's `request`): entry point and
source folder from the script, hyperparameters from the script's arguments (Accelerate's typing rules),
the job environment, the distribution, instance type and count, the image, input channels and metric
definitions from the TSV files, and `additional_args` merged on top. Secrets never enter it: AWS keys
and secret job variables stay in this process's memory (credentials.py). The job handle (job.py) reads
the plan's spec, submits the job with the SageMaker SDK 3 (`ModelTrainer`), follows it and stops it when
interrupted; this module knows nothing of it.

Deliberate differences from Accelerate (docs/compatibility.md) are marked "Accelerate:" below.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from prefect_accelerate.config.enums import (
    SAGEMAKER_BASE_JOB_NAME,
    SAGEMAKER_PYTHON_VERSION,
    SAGEMAKER_PYTORCH_VERSION,
    SAGEMAKER_TRANSFORMERS_VERSION,
)
from prefect_accelerate.config.model import SageMakerConfig
from prefect_accelerate.errors import ConfigError, DependencyError, UsageError
from prefect_accelerate.launchers.engines.sagemaker import credentials as aws_credentials
from prefect_accelerate.launchers import environment as blocks
from prefect_accelerate.secrets import REDACTED, is_secret_name
from prefect_accelerate.launchers.host import HostProbe
from prefect_accelerate.launchers.plan import LaunchPlan
from prefect_accelerate.launchers.engines.sagemaker.hparams import script_hyperparameters, serialize_hyperparameter

#: SageMaker job names are at most 63 characters; the SDK appends "-YYYYmmddHHMMSS" (15) to the base name
MAX_BASE_JOB_NAME = 48
_JOB_NAME_CHARS = re.compile(r"[^A-Za-z0-9-]+")


class SageMakerJobSpec(BaseModel):
    """The training job a launch submits (the plan's `request`), secrets left out.

    Field names follow SageMaker SDK 3's ModelTrainer and its config objects (Compute, StoppingCondition,
    Networking, ...); `additional_args` in the config may use Accelerate's (SDK 2 estimator) names.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    region: str
    credentials: aws_credentials.CredentialSource
    role: str
    base_job_name: str
    image_uri: str
    image_source: str
    source_dir: str
    entry_script: str
    requirements: str | None = None
    instance_type: str
    instance_count: int = 1
    #: {"torchrun": {...}} or {"mpi": {...}}, or None (one process per instance)
    distribution: dict[str, dict[str, Any]] | None = None
    hyperparameters: dict[str, Any] = Field(default_factory=dict)
    #: the job's environment; values of secret variables are shown as *** (the real ones stay in memory)
    environment: dict[str, str] = Field(default_factory=dict)
    secret_environment: tuple[str, ...] = ()
    metric_definitions: list[dict[str, str]] = Field(default_factory=list)
    #: channel -> S3 URI (or a local path the SDK uploads)
    inputs: dict[str, str] = Field(default_factory=dict)
    compute: dict[str, Any] = Field(default_factory=dict)
    stopping_condition: dict[str, Any] = Field(default_factory=dict)
    networking: dict[str, Any] = Field(default_factory=dict)
    output_path: str | None = None
    output_kms_key: str | None = None
    output_compression: str | None = None
    checkpoint_s3_uri: str | None = None
    checkpoint_local_path: str | None = None
    code_location: str | None = None
    training_input_mode: str | None = None
    tags: list[dict[str, str]] = Field(default_factory=list)

    @property
    def handle(self) -> str | None:
        return self.credentials.handle


# ------------------------------------------------------------------------------------------------
# Job names, files


def unique_base_job_name(base: str, run_dir: str | None) -> str:
    """`base` made valid for SageMaker and unique per launch (Accelerate: the fixed `accelerate-sagemaker-1`)."""
    clean = _JOB_NAME_CHARS.sub("-", base.replace("_", "-")).strip("-") or SAGEMAKER_BASE_JOB_NAME
    suffix = hashlib.sha1(Path(run_dir or "").name.encode()).hexdigest()[:6]  # the run folder's name is unique per launch
    return f"{clean[: MAX_BASE_JOB_NAME - len(suffix) - 1].rstrip('-')}-{suffix}"


def _tsv_rows(path: str, cwd: str, what: str) -> list[tuple[int, list[str]]]:
    file = Path(cwd, path).expanduser()
    try:
        lines = file.read_text().splitlines()
    except OSError as error:
        raise ConfigError(f"The SageMaker {what} file {file} could not be read ({error.strerror}). Check {what.replace(' ', '_')}_file in the config.") from None
    rows = []
    for number, line in enumerate(lines[1:], start=2):  # the first line is a header, as in Accelerate
        if not line.strip():
            continue
        cells = line.split("\t")
        if len(cells) < 2 or not cells[0].strip() or not cells[1].strip():
            raise ConfigError(f"{file}, line {number}: expected two tab-separated columns, got {line!r}.")
        rows.append((number, [c.strip() for c in cells]))
    return rows


def read_inputs(path: str, cwd: str) -> dict[str, str]:
    """Channels from the inputs TSV (header `channel_name<TAB>data_location`)."""
    return {cells[0]: cells[1] for _, cells in _tsv_rows(path, cwd, "inputs")}


def read_metrics(path: str, cwd: str) -> list[dict[str, str]]:
    """Metric definitions from the metrics TSV (header `metric_name<TAB>metric_regex`)."""
    return [{"Name": cells[0], "Regex": cells[1]} for _, cells in _tsv_rows(path, cwd, "metrics")]


# ------------------------------------------------------------------------------------------------
# Image


def _installed(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _release(text: str) -> tuple[int, ...]:
    from packaging.version import Version

    return Version(text).release


def resolve_image(config: SageMakerConfig, instance_type: str, overrides: dict[str, Any]) -> tuple[str, str]:
    """(image URI, how it was chosen): the config's image_uri, else a Hugging Face training image resolved
    offline with the SDK's image_uris table.

    Versions the config sets (other than Accelerate's defaults 1.10.2 / 4.17.0 / py38, which its
    questionnaire always writes) are used as given; otherwise the image that matches the installed torch
    (and transformers) is chosen, or the newest one older than it. Accelerate: always the defaults, i.e. a
    2022 PyTorch 1.10 image.
    """
    if overrides.get("image_uri") or config.image_uri:
        return str(overrides.get("image_uri") or config.image_uri), "image_uri from the config"
    try:
        from sagemaker.core import image_uris
    except ImportError:
        raise DependencyError.missing("sagemaker", "sagemaker", "Choosing a SageMaker training image (no image_uri in the config)") from None
    pt = overrides.get("pytorch_version") or (config.pytorch_version if config.pytorch_version != SAGEMAKER_PYTORCH_VERSION else None)
    tf = overrides.get("transformers_version") or (config.transformers_version if config.transformers_version != SAGEMAKER_TRANSFORMERS_VERSION else None)
    py = overrides.get("py_version") or (config.py_version if config.py_version != SAGEMAKER_PYTHON_VERSION else None)
    table = image_uris.config_for_framework("huggingface")["training"]["versions"]
    candidates = [(tf_v, key[len("pytorch"):], entry[key].get("py_versions", []))
                  for tf_v, entry in table.items() for key in entry if key.startswith("pytorch")]
    how = "resolved offline for the config's versions"
    if not (pt and tf):
        local_pt, local_tf = _installed("torch"), _installed("transformers")
        pool = [c for c in candidates if (not tf or c[0] == tf) and (not pt or _release(c[1])[:2] == _release(pt)[:2])]
        if not pt and local_pt:
            wanted = _release(local_pt)[:2]
            same = [c for c in pool if _release(c[1])[:2] == wanted]
            older = [c for c in pool if _release(c[1])[:2] < wanted]
            pool = same or older or pool
            how = (f"matching the installed torch {local_pt}" if same else
                   f"the newest image older than the installed torch {local_pt} (no image for it)")
        if not pool:
            raise ConfigError(
                f"No Hugging Face training image matches pytorch_version={pt} transformers_version={tf} in this SageMaker "
                "SDK's table. Set image_uri in the config, or versions that exist (see sagemaker.core.image_uris)."
            )
        exact_tf = [c for c in pool if local_tf and c[0] == local_tf]
        choice = exact_tf[0] if exact_tf else max(pool, key=lambda c: (_release(c[1]), _release(c[0])))
        tf, pt = choice[0], pt or choice[1]
        py = py or (sorted(choice[2], key=lambda v: int(v[2:]) if v[2:].isdigit() else 0)[-1] if choice[2] else None)
    try:
        uri = image_uris.retrieve(framework="huggingface", region=config.region, version=tf, base_framework_version=f"pytorch{pt}",
                                  py_version=py, instance_type=instance_type, image_scope="training")
        return uri, f"Hugging Face training image (transformers {tf}, pytorch {pt}, {py}) {how}"
    except ValueError as error:
        if "processor" not in str(error):
            raise ConfigError(f"No SageMaker training image for transformers {tf} / pytorch {pt} / {py}: {error} Set image_uri in the config.") from None
    try:  # Hugging Face images are GPU-only; CPU instances get the PyTorch framework image
        uri = image_uris.retrieve(framework="pytorch", region=config.region, version=pt, instance_type=instance_type, image_scope="training",
                                  py_version=py)
    except ValueError as error:
        raise ConfigError(f"No SageMaker training image for {instance_type} with pytorch {pt}: {error} Set image_uri in the config.") from None
    return uri, f"PyTorch {pt} training image ({instance_type} is a CPU instance; transformers is not preinstalled: add it to requirements.txt)"


# ------------------------------------------------------------------------------------------------
# additional_args (Accelerate merges them into the SDK 2 HuggingFace estimator's arguments)

_SCALAR_MAP = {  # estimator argument -> (spec field, sub-field)
    "volume_size": ("compute", "volume_size_in_gb"),
    "volume_kms_key": ("compute", "volume_kms_key_id"),
    "keep_alive_period_in_seconds": ("compute", "keep_alive_period_in_seconds"),
    "use_spot_instances": ("compute", "enable_managed_spot_training"),
    "max_run": ("stopping_condition", "max_runtime_in_seconds"),
    "max_wait": ("stopping_condition", "max_wait_time_in_seconds"),
    "max_pending_time": ("stopping_condition", "max_pending_time_in_seconds"),
    "subnets": ("networking", "subnets"),
    "security_group_ids": ("networking", "security_group_ids"),
    "enable_network_isolation": ("networking", "enable_network_isolation"),
    "encrypt_inter_container_traffic": ("networking", "enable_inter_container_traffic_encryption"),
}
_DIRECT = {"image_uri", "role", "instance_type", "instance_count", "output_path", "output_kms_key", "checkpoint_s3_uri",
           "checkpoint_local_path", "code_location", "requirements"}
_VERSIONS = {"pytorch_version", "transformers_version", "py_version"}
_IGNORED = {"debugger_hook_config", "disable_profiler", "profiler_config", "container_log_level"}
_NESTED = {"compute", "stopping_condition", "networking"}
_KNOWN = set(_SCALAR_MAP) | _DIRECT | _VERSIONS | _IGNORED | _NESTED | {
    "environment", "hyperparameters", "metric_definitions", "distribution", "tags", "base_job_name", "entry_point",
    "source_dir", "input_mode", "disable_output_compression"}


def distribution_from(value: Any) -> dict[str, dict[str, Any]] | None:
    """An SDK 2 `distribution` dict as SDK 3 distributed settings (torchrun or MPI)."""
    if not value:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"additional_args.distribution must be a mapping, got {value!r}.")
    enabled = lambda key, sub=None: bool((value.get(key) or {}).get(sub or "enabled", False)) if isinstance(value.get(key), dict) else False  # noqa: E731
    if enabled("torch_distributed") or enabled("pytorchddp") or (isinstance(value.get("smdistributed"), dict)
                                                                 and (value["smdistributed"].get("dataparallel") or {}).get("enabled")):
        return {"torchrun": {"process_count_per_node": None}}
    if enabled("mpi"):
        mpi = value["mpi"]
        options = str(mpi.get("custom_mpi_options") or "").split()
        return {"mpi": {"process_count_per_node": mpi.get("processes_per_host"), "mpi_additional_options": options or None}}
    if "torchrun" in value or "mpi" in value:  # already SDK 3 shaped
        return {k: dict(v or {}) for k, v in value.items() if k in ("torchrun", "mpi")}
    raise ConfigError(
        f"additional_args.distribution {value!r} is not supported. Use {{'torch_distributed': {{'enabled': True}}}}, "
        "{'smdistributed': {'dataparallel': {'enabled': True}}} or {'mpi': {'enabled': True, 'processes_per_host': N}}."
    )


def _tags(value: Any) -> list[dict[str, str]]:
    if isinstance(value, dict):
        return [{"Key": str(k), "Value": str(v)} for k, v in value.items()]
    if isinstance(value, list) and all(isinstance(t, dict) and {"Key", "Value"} <= set(t) for t in value):
        return [{"Key": str(t["Key"]), "Value": str(t["Value"])} for t in value]
    raise ConfigError(f"additional_args.tags must be a mapping or a list of {{Key, Value}}, got {value!r}.")


def apply_additional_args(fields: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Merge `additional_args` into the job fields as Accelerate does (nested dicts merged, scalars replaced)."""
    unknown = sorted(set(extra) - _KNOWN)
    if unknown:
        from prefect_accelerate.errors import did_you_mean

        raise ConfigError(
            f"additional_args has {', '.join(repr(k) for k in unknown)}, which this launcher does not know.{did_you_mean(unknown[0], _KNOWN)} "
            f"Supported: {', '.join(sorted(_KNOWN))}."
        )
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in fields.items()}
    for key, value in extra.items():
        if key in _SCALAR_MAP:
            section, name = _SCALAR_MAP[key]
            out[section][name] = value
        elif key in _NESTED:
            out[key].update(value or {})
        elif key in ("environment", "hyperparameters"):
            out[key].update({str(k): v for k, v in (value or {}).items()})
        elif key in _DIRECT or key == "metric_definitions":
            out[key] = value
        elif key == "distribution":
            out["distribution"] = distribution_from(value)
        elif key == "tags":
            out["tags"] = _tags(value)
        elif key == "input_mode":
            out["training_input_mode"] = value
        elif key == "disable_output_compression":
            out["output_compression"] = "NONE" if value else None
    return out


# ------------------------------------------------------------------------------------------------
# The plan


class _RemoteHost(HostProbe):
    """fp8 availability is the training container's business, not the launching machine's."""

    def fp8_available(self) -> bool:
        return True


def job_environment(options, config: SageMakerConfig) -> dict[str, str]:
    """ACCELERATE_* for the job (reference §4.3.5); the config's dynamo_config applies unless flags say otherwise.

    Accelerate ignores a SageMaker config's dynamo_config (the backend is always `no`).
    """
    dynamo = {k: (v.value if hasattr(v, "value") else v) for k, v in config.dynamo_config.launch_items().items()
              if not options.is_given(k)}
    effective = options.with_changes(**dynamo) if dynamo else options
    env = {"ACCELERATE_USE_SAGEMAKER": "true"}
    env |= blocks.mixed_precision_env(effective)
    env |= blocks.dynamo_env(effective)
    env["ACCELERATE_SAGEMAKER_DISTRIBUTED_TYPE"] = config.distributed_type.value
    env |= blocks.fp8_env(effective, _RemoteHost())
    if effective.debug:
        env["ACCELERATE_DEBUG_MODE"] = "true"
    return env


def plan(options, host: HostProbe, *, cwd: str, run_dir: str | None) -> LaunchPlan:
    """The plan (a SageMakerJobSpec as `request`) for a launch with a SageMaker config. Submits nothing.

    Raises:
        UsageError: -m/--no_python, a script that is not a .py file, script arguments that are not `--name value`.
        ConfigError: a SageMaker setting that cannot work (unknown additional_args, unreadable TSV, no image).
    """
    config: SageMakerConfig | None = options.sagemaker
    if config is None:
        raise ConfigError("A SageMaker launch needs a SageMaker config file (compute_environment: AMAZON_SAGEMAKER); run `prefect-accelerate config`.")
    if options.module or options.no_python:
        raise UsageError("SageMaker runs a Python training script file; it cannot be used with --module or --no_python.")
    script = Path(options.training_script)
    if script.suffix != ".py":
        raise UsageError(f"SageMaker runs a Python training script; {options.training_script!r} is not a .py file.")
    source_dir = str(Path(cwd, script.parent).resolve())
    handle = Path(run_dir).name if run_dir else hashlib.sha1(repr(options).encode()).hexdigest()[:12]
    hyperparameters = script_hyperparameters(options.training_script_args)
    extra = dict(config.additional_args or {})

    warnings = [w for w in [options.defaults_warning] if w]
    notes = list(options.notes)
    distribution = None
    if config.distributed_type.value == "DATA_PARALLEL":
        distribution = {"torchrun": {"process_count_per_node": None}}
    elif config.distributed_type.value == "MODEL_PARALLEL":
        warnings.append("distributed_type MODEL_PARALLEL has no SageMaker distribution (as in Accelerate): the script "
                        "runs once per instance. Use DATA_PARALLEL, or set additional_args.distribution.")
    fields: dict[str, Any] = {
        "role": config.iam_role_name,
        "instance_type": config.ec2_instance_type,
        "instance_count": int(options.num_machines or config.num_machines),
        "distribution": distribution,
        "hyperparameters": hyperparameters,
        "environment": job_environment(options, config),
        "metric_definitions": read_metrics(config.sagemaker_metrics_file, cwd) if config.sagemaker_metrics_file else [],
        "compute": {}, "stopping_condition": {}, "networking": {},
        "output_path": None, "output_kms_key": None, "output_compression": None, "checkpoint_s3_uri": None,
        "checkpoint_local_path": None, "code_location": None, "requirements": None, "training_input_mode": None,
        "tags": [], "image_uri": None,
    }
    fields = apply_additional_args(fields, extra)
    for key in ("entry_point", "source_dir"):
        if key in extra:
            raise ConfigError(f"additional_args.{key} cannot change the script: it is the launch's training script ({options.training_script}).")
    image, image_source = resolve_image(config, str(fields["instance_type"]), {k: extra.get(k) for k in (*_VERSIONS, "image_uri")})

    secret_names = tuple(sorted(name for name in fields["environment"] if is_secret_name(name)))  # the one rule
    secret_env = {name: SecretStr(str(fields["environment"][name])) for name in secret_names}
    shown_environment = {k: (REDACTED if k in secret_names else str(v)) for k, v in fields["environment"].items()}
    block = getattr(options, "aws_credentials_block", None) or os.environ.get(aws_credentials.AWS_BLOCK_ENV) or None
    credentials = aws_credentials.choose_source(options, profile=config.profile, handle=handle, block=block)
    if secret_env:
        aws_credentials.add_environment(handle, secret_env)
        credentials = credentials.model_copy(update={"handle": handle})
    notes.append(f"AWS credentials: {credentials.describe()}; region {config.region}.")
    notes.append(f"Image: {image} ({image_source}).")

    spec = SageMakerJobSpec(
        region=config.region, credentials=credentials, role=str(fields["role"]),
        base_job_name=unique_base_job_name(str(extra.get("base_job_name") or config.base_job_name), run_dir),
        image_uri=image, image_source=image_source, source_dir=source_dir, entry_script=script.name,
        requirements=fields["requirements"], instance_type=str(fields["instance_type"]), instance_count=int(fields["instance_count"]),
        distribution=fields["distribution"], hyperparameters=fields["hyperparameters"], environment=shown_environment,
        secret_environment=secret_names, metric_definitions=list(fields["metric_definitions"] or []),
        inputs=read_inputs(config.sagemaker_inputs_file, cwd) if config.sagemaker_inputs_file else {},
        compute=fields["compute"], stopping_condition=fields["stopping_condition"], networking=fields["networking"],
        output_path=fields["output_path"], output_kms_key=fields["output_kms_key"], output_compression=fields["output_compression"],
        checkpoint_s3_uri=fields["checkpoint_s3_uri"], checkpoint_local_path=fields["checkpoint_local_path"],
        code_location=fields["code_location"], training_input_mode=fields["training_input_mode"], tags=fields["tags"],
    )
    container_args = [arg for key, value in spec.hyperparameters.items() for arg in (f"--{key}", serialize_hyperparameter(value))]
    return LaunchPlan(
        launcher="sagemaker",
        argv=("python", spec.entry_script, *container_args),
        cwd=cwd,
        num_processes=spec.instance_count,
        num_machines=spec.instance_count,
        run_dir=run_dir,
        warnings=tuple(warnings),
        notes=tuple(notes),
        request=spec.model_dump(mode="json"),
    )

