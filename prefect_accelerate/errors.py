"""One error hierarchy for the whole package.

Every message is one paragraph that says what went wrong, where (file, field, rank) and what to do.
The CLI prints the message without a traceback and exits with ``exit_code``.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterable, Iterator
from typing import Any

from prefect_accelerate.secrets import Redactor, known_secret_values

#: Exit status for usage and configuration errors, as argparse uses.
USAGE_EXIT_CODE = 2


class PrefectAccelerateError(Exception):
    """Base class: a user-facing failure with a one-paragraph message."""

    exit_code: int = 1

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        # a message echoes what the user gave (a config value, an argument): a known secret value never goes
        # further than here, whether the CLI prints it or Prefect stores it in a state or a log
        super().__init__(Redactor(known_secret_values())(message))
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

    @classmethod
    def broken(cls, module: str, error: BaseException, purpose: str) -> DependencyError:
        """`module` is installed but its import fails (a build for another torch, a half-finished install)."""
        reason = f"{type(error).__name__}: {error}".strip().rstrip(".")
        if module == "torchvision":
            fix = (
                "That usually means this torchvision was built for another torch than the installed one. Install "
                "the torchvision release built for your torch (keep torch pinned with `-c` a constraints file), or "
                "`pip uninstall torchvision` if nothing else needs it"
            )
        else:
            fix = f"Reinstall `{module}` for this Python and this torch (keep torch pinned with `-c` a constraints file)"
        return cls(f"{purpose} imports `{module}`, which is installed but fails to import ({reason}). {fix}, then run the command again.")


@contextlib.contextmanager
def broken_imports_reported(purpose: str) -> Iterator[None]:
    """Turn an exception that a failing import caused (inside the block) into a one-paragraph DependencyError."""
    try:
        yield
    except PrefectAccelerateError:
        raise
    except Exception as error:
        found = failed_import(error)
        if found is None:
            raise
        raise DependencyError.broken(found[0], found[1], purpose) from None


def failed_import(error: BaseException) -> tuple[str, BaseException] | None:
    """If `error` (or what caused it) happened while a module was being imported: (its top-level package, the error).

    It is the innermost module whose top-level code was running when the import failed, e.g. `torchvision`
    for `RuntimeError: operator torchvision::nms does not exist` raised from torch while torchvision's
    `_meta_registrations` module ran. None for an error that no import caused.
    """
    import traceback

    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        # a module's top-level code (a `<module>` frame) below the frame that caught the error means an import
        # was running; Python drops importlib's own frames from tracebacks, so they cannot be the sign
        for frame in reversed(traceback.extract_tb(current.__traceback__)):
            package = _installed_package(frame.filename) if frame.name == "<module>" else None
            if package:
                return package, current
        current = current.__cause__ or current.__context__
    return None


def _installed_package(filename: str) -> str | None:
    """The top-level package (or module) a source file belongs to, by the sys.path entry that holds it."""
    import os
    import sys

    path = os.path.abspath(filename)
    roots = sorted((os.path.abspath(entry) for entry in sys.path if entry), key=len, reverse=True)
    for root in roots:
        if path.startswith(root + os.sep):
            first = path[len(root) + 1:].split(os.sep, 1)[0]
            return first.removesuffix(".py") or None
    return None


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
    text = repr(value)
    if len(text) > 80:  # a long value must not drown the message around it
        text = text[:77] + "..."
    if isinstance(value, str):
        return text
    return f"{text} ({type(value).__name__})"
