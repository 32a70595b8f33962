"""Preflight pipelines as data: steps, their content-hash keys, the DAG, and its rendering.

Nothing here imports Prefect: `prefect-accelerate plan` uses it to say which steps would run or come
from the cache and why, and the flows in prefect_accelerate.flows.pipeline use the same keys as
Prefect cache keys.
"""
