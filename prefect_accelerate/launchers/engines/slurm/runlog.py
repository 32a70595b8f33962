"""Where a job handle's lines go when no callback was given: the Prefect run logger in a run, else stdout."""

from __future__ import annotations


def log_line(label: str, line: str) -> None:
    try:
        from prefect import get_run_logger

        get_run_logger().info("[%s] %s", label, line)
    except Exception:  # outside a flow or task run (MissingContextError), or Prefect not importable
        print(f"[{label}] {line}", flush=True)
