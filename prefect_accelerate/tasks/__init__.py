"""Prefect tasks: thin wrappers that add retries, caching, run names, logging and artifacts.

Importing this package imports Prefect. The business logic lives in the core packages
(config, envreport, memory, launchers), which never import Prefect.
"""

from __future__ import annotations

from prefect_accelerate._lazy import lazy_getattr
from prefect_accelerate.tasks import expected_errors

# a failed training or a bad config is logged by Prefect as its message, not as a traceback
expected_errors.install()

_EXPORTS = {
    "config_default": "prefect_accelerate.tasks.config",
    "config_update": "prefect_accelerate.tasks.config",
    "load_config": "prefect_accelerate.tasks.config",
    "to_fsdp2": "prefect_accelerate.tasks.config",
    "env_report": "prefect_accelerate.tasks.env",
    "launch": "prefect_accelerate.tasks.launch",
    "install_test": "prefect_accelerate.tasks.selftest",
    "estimate_memory": "prefect_accelerate.tasks.memory",
    "memory_fit": "prefect_accelerate.tasks.memory",
    "tpu_config": "prefect_accelerate.tasks.tpu",
    "merge_weights": "prefect_accelerate.tasks.merge",
}

__all__ = list(_EXPORTS)


__getattr__ = lazy_getattr('prefect_accelerate.tasks', _EXPORTS)
