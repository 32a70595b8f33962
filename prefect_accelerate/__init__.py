"""prefect-accelerate: Hugging Face Accelerate's command-line workflow as Prefect 3 tasks and flows.

The package root stays light on purpose: `prefect-accelerate --help` and `launch --dry-run` must not
import torch or prefect. Public names are re-exported lazily; ``from prefect_accelerate import
check_environment`` imports Prefect only at that moment.
"""

from __future__ import annotations

from prefect_accelerate._lazy import lazy_getattr
from prefect_accelerate._version import __version__

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "ClusterConfig": "prefect_accelerate.config.model",
    "SageMakerConfig": "prefect_accelerate.config.model",
    "load_config_file": "prefect_accelerate.config.io",
    "save_config_file": "prefect_accelerate.config.io",
    "default_config_path": "prefect_accelerate.config.paths",
    "EnvReport": "prefect_accelerate.envreport.probe",
    "collect_env_report": "prefect_accelerate.envreport.probe",
    "estimate": "prefect_accelerate.memory.core",
    "check_fit": "prefect_accelerate.memory.fit",
    "EstimateOptions": "prefect_accelerate.memory.models",
    "MemoryEstimate": "prefect_accelerate.memory.models",
    "FitVerdict": "prefect_accelerate.memory.models",
    "build_launch_options": "prefect_accelerate.launchers.options",
    "plan_launch": "prefect_accelerate.launchers",
    "LaunchPlan": "prefect_accelerate.launchers.plan",
    "LaunchResult": "prefect_accelerate.launchers.result",
    "PipelineRequest": "prefect_accelerate.pipeline.models",
    "check_environment": "prefect_accelerate.flows.check",
    "launch_training": "prefect_accelerate.flows.pipeline",
    "PrefectAccelerateError": "prefect_accelerate.errors",
    "ConfigError": "prefect_accelerate.errors",
    "LaunchError": "prefect_accelerate.errors",
}

__all__ = ["__version__", *_EXPORTS]


__getattr__ = lazy_getattr('prefect_accelerate', _EXPORTS)
