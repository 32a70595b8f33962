"""One error hierarchy for the whole package.

Every message is one paragraph that says what went wrong, where (file, field, rank) and what to do.
The CLI prints the message without a traceback and exits with ``exit_code``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

#: Exit status for usage and configuration errors, as argparse uses.
USAGE_EXIT_CODE = 2


class PrefectAccelerateError(Exception):
    """Base class: a user-facing failure with a one-paragraph message."""

    exit_code: int = 1

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self):  # keep exit_code across pickling (Prefect persists exceptions)
        return (_rebuild_error, (type(self), self.message, self.exit_code))


def _rebuild_error(cls: type[PrefectAccelerateError], message: str, exit_code: int) -> PrefectAccelerateError:
    return cls(message, exit_code=exit_code)


class UsageError(PrefectAccelerateError):
    """Bad command-line usage (flags that contradict each other, a missing argument)."""

    exit_code = USAGE_EXIT_CODE


class ConfigError(PrefectAccelerateError):
    """An Accelerate config file (or the options built from it) is missing, unreadable or invalid."""

    exit_code = USAGE_EXIT_CODE


class DependencyError(PrefectAccelerateError):
    """An optional dependency is missing; the message names the extra to install."""

    exit_code = USAGE_EXIT_CODE

    @classmethod
    def missing(cls, module: str, extra: str, purpose: str) -> DependencyError:
        return cls(
            f"{purpose} needs the Python package `{module}`, which is not installed in this environment. "
            f"Install it with `pip install 'prefect-accelerate[{extra}]'` (keep your torch pinned with "
            f"`-c` a constraints file so pip does not replace it), then run the command again."
        )


class LaunchError(PrefectAccelerateError):
    """A launch could not start, or the training processes failed.

    ``exit_code`` is the failing worker's own exit status when it is known, so the CLI can pass it on.
    """


class EstimateError(PrefectAccelerateError):
    """A model could not be sized (no config, unknown architecture, missing library...)."""

    exit_code = USAGE_EXIT_CODE


class MergeError(PrefectAccelerateError):
    """A distributed checkpoint could not be merged."""

    exit_code = USAGE_EXIT_CODE


class PreflightError(PrefectAccelerateError):
    """A preflight step (config, environment, memory fit, self-test) says the launch would fail."""


class Terminated(BaseException):
    """SIGTERM reached a process that had no handler of its own (the plain CLI); raised to unwind cleanly."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"received signal {signum}")
        self.signum = signum


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """Return ' Did you mean `x`?' for the closest candidate, or '' when nothing is close."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" Did you mean `{close[0]}`?" if close else ""


def describe_value(value: Any) -> str:
    """Show a value the way the user wrote it, with its type when that matters."""
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, bool) or value is None:
        return f"{value!r} ({type(value).__name__})"
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"
