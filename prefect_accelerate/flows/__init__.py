"""Prefect flows composing the tasks into pipelines. Importing this package imports Prefect."""

from __future__ import annotations

from prefect_accelerate._lazy import lazy_getattr

_EXPORTS = {
    "check_environment": "prefect_accelerate.flows.check",
    "env_flow": "prefect_accelerate.flows.check",
    "config_default_flow": "prefect_accelerate.flows.config",
    "config_update_flow": "prefect_accelerate.flows.config",
    "to_fsdp2_flow": "prefect_accelerate.flows.config",
    "launch_flow": "prefect_accelerate.flows.launch",
    "end_launch_processes": "prefect_accelerate.flows.launch",
    "install_test_flow": "prefect_accelerate.flows.selftest",
    "preflight": "prefect_accelerate.flows.pipeline",
    "launch_training": "prefect_accelerate.flows.pipeline",
    "validate_configs": "prefect_accelerate.flows.validate",
    "tpu_config_flow": "prefect_accelerate.flows.tpu",
    "merge_weights_flow": "prefect_accelerate.flows.merge",
    "estimate_memory_flow": "prefect_accelerate.flows.memory",
    "node_launch": "prefect_accelerate.flows.multinode",
    "multinode_launch": "prefect_accelerate.flows.multinode",
}

__all__ = list(_EXPORTS)


__getattr__ = lazy_getattr('prefect_accelerate.flows', _EXPORTS)
