"""Our expected failures reach Prefect's logs as their message, without a Python traceback.

When a task or flow raises, Prefect's engines log "Task run failed with exception: ..." and "Encountered
exception during execution: ..." with the traceback attached. For a PrefectAccelerateError (a failed
training, a launch stopped by its deadline, a bad config) the one-paragraph message is the whole story
and the traceback only buries it, in the console and in the run's logs alike. This filter keeps the record
and drops the traceback for those errors only; anything else (a bug of ours, a crash in Prefect) keeps it.
Standard library only, so installing it imports nothing heavy.
"""

from __future__ import annotations

import logging

from prefect_accelerate.errors import PrefectAccelerateError

#: the loggers Prefect's task and flow engines report exceptions on
ENGINE_LOGGERS = ("prefect.task_runs", "prefect.flow_runs")


class ExpectedErrorsWithoutTraceback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc_info = record.exc_info
        if exc_info and isinstance(exc_info, tuple) and isinstance(exc_info[1], PrefectAccelerateError):
            record.exc_info = None
            record.exc_text = None
        return True


FILTER = ExpectedErrorsWithoutTraceback()


def install() -> None:
    """Add the filter to Prefect's engine loggers (idempotent: a logger holds a filter once)."""
    for name in ENGINE_LOGGERS:
        logger = logging.getLogger(name)
        if FILTER not in logger.filters:
            logger.addFilter(FILTER)
