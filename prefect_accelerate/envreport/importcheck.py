"""Which optional engines are installed, and whether they actually import.

"Installed" comes from `importlib.util.find_spec` and the distribution metadata, which cost nothing.
"Importable" needs a real import, and real imports of these packages are slow (deepspeed, timm and
torchvision take seconds), noisy (deepspeed logs on import) and can fail in ways find_spec cannot see:
on a CPU torch with a CUDA torchvision wheel, `import timm` raises RuntimeError. So the imports run in
one child Python process, started before the rest of the probe so the two overlap; a failure, a crash
or a hang there becomes a line in the report, never an error in ours.

"Importable" means what the commands import, not just the top-level package: `import transformers`
succeeds where `from transformers import LlamaConfig` (what estimate-memory does through AutoConfig)
fails on a torchvision built for another torch. Each engine lists the imports our commands run, and a
failure names the statement and the package that broke it.

A check where every engine imported is kept for a while in the cache folder (PREFECT_ACCELERATE_CACHE_DIR,
else ~/.cache/prefect-accelerate), keyed on what decides
an import: the interpreter, each folder on the import path with its modification time (installing,
upgrading or removing a distribution adds or removes entries, which changes it), the
variables that steer imports and loaders, and the engines' versions and statements. The next probe with
the same key reads the result instead of importing again (a `check`, a pipeline and a nightly validation
each probe); any failure is re-checked every time, as that is what a user is then diagnosing.
`PREFECT_ACCELERATE_IMPORT_CHECK_CACHE=0` turns the reuse off.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

#: How long the child may take to import every engine before the rest are reported as unchecked
#: (a loaded 2-core machine needed over 60 s for deepspeed, sagemaker, transformers' config classes and timm).
IMPORT_CHECK_TIMEOUT_S = 120.0
#: How long a check where everything imported is reused while its key holds (12 hours)
IMPORT_CHECK_REUSE_S = 12 * 3600
#: "0" turns the reuse off (every probe imports again)
IMPORT_CHECK_CACHE_ENV = "PREFECT_ACCELERATE_IMPORT_CHECK_CACHE"
#: variables that change what an import finds or loads
_IMPORT_VARIABLES = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "LD_LIBRARY_PATH", "LD_PRELOAD", "CUDA_HOME", "DS_ACCELERATOR")


@dataclass(frozen=True)
class EngineSpec:
    """An optional engine: its import name, its distribution on PyPI and our extra that installs it."""

    module: str
    distribution: str
    extra: str
    #: the import statements our commands run (after `import <module>`): the check tries each
    statements: tuple[str, ...] = ()


#: The engines `env` reports, in the order it reports them.
OPTIONAL_ENGINES: tuple[EngineSpec, ...] = (
    EngineSpec("deepspeed", "deepspeed", "deepspeed", ("from deepspeed.accelerator import get_accelerator",)),
    EngineSpec("torch_xla", "torch_xla", "tpu", ("import torch_xla.core.xla_model",)),
    EngineSpec("sagemaker", "sagemaker", "sagemaker", ("from sagemaker.train import ModelTrainer",)),
    # estimate-memory: AutoConfig reads config.json and resolves a model family's config class, the import
    # that fails first on a torchvision built for another torch (the modeling imports would double the time)
    EngineSpec("transformers", "transformers", "transformers", ("from transformers import AutoConfig, LlamaConfig",)),
    EngineSpec("timm", "timm", "timm", ("from timm import create_model",)),
)


@dataclass(frozen=True)
class EngineProbe:
    """What was found for one engine. ``importable`` is None when no import was tried."""

    module: str
    installed: bool
    version: str | None
    importable: bool | None
    error: str | None = None


# The child moves its own stdout onto stderr first, so whatever an import prints cannot be mistaken
# for a result; results go, one JSON line each and flushed, to the saved stdout. A crash therefore
# leaves the results so far, and the first missing one names the import that killed the process.
_CHILD = r"""
import json, os, signal, sys
# Ctrl-C reaches the whole terminal group: the parent stops and ends this process; an import cut short
# here must not become a verdict ("not importable: KeyboardInterrupt") in a report that is still printed
signal.signal(signal.SIGINT, signal.SIG_IGN)
# the commands run as console scripts or `-m`, with no working folder on the path: nor does this check
if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr

def culprit(error):
    try:
        from prefect_accelerate.errors import failed_import
        found = failed_import(error)
    except BaseException:
        found = None
    return found or (None, error)

for item in sys.argv[1:]:
    name, *statements = json.loads(item)
    result = {"module": name, "ok": True, "error": None}
    for statement in ["import " + name, *statements]:
        try:
            exec(statement, {})
        except BaseException as error:
            package, cause = culprit(error)
            text = (str(cause).strip().splitlines() or [""])[0]
            why = type(cause).__name__ + (": " + text if text else "")
            if statement != "import " + name:
                why = "`" + statement + "` fails: " + why
            if package and package != name:
                why += " (raised while importing " + package + ")"
            result = {"module": name, "ok": False, "error": why[:400]}
            break
    out.write(json.dumps(result) + "\n")
    out.flush()
"""


def _installed(spec: EngineSpec) -> tuple[bool, str | None]:
    try:
        found = importlib.util.find_spec(spec.module) is not None
    except (ImportError, ValueError):  # a broken parent package, or a module with __spec__ None
        found = False
    try:
        version = importlib.metadata.version(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        version = None
    return found, version


def _mtime(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _reuse_key(to_import: Sequence[str], installed: dict[str, tuple[bool, str | None]]) -> str:
    cwd = os.getcwd()
    facts = {
        "python": [sys.executable, sys.version],
        # the child drops the working folder from its path (see _CHILD); the rest of ours is a superset of its
        "path": [[entry, _mtime(entry)] for entry in sys.path if entry not in ("", cwd)],
        "variables": {name: os.environ.get(name) for name in _IMPORT_VARIABLES},
        "imports": list(to_import),
        "versions": {name: version for name, (_, version) in sorted(installed.items())},
        "child": hashlib.sha256(_CHILD.encode()).hexdigest(),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:24]


def _reuse_path(key: str):
    from prefect_accelerate.launchers.state import cache_dir

    return cache_dir() / "import-check" / f"{key}.json"


def _reuse_on() -> bool:
    return os.environ.get(IMPORT_CHECK_CACHE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _read_reused(key: str) -> tuple[float, dict[str, tuple[bool, str | None]]] | None:
    """The kept result for `key` while it is fresh, else None (a damaged or foreign file is ignored)."""
    try:
        data = json.loads(_reuse_path(key).read_text())
        checked_at = float(data["checked_at"])
        modules = {str(name): (True, None) for name in data["modules"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not 0 <= time.time() - checked_at < IMPORT_CHECK_REUSE_S:
        return None
    return checked_at, modules


def _keep(key: str, modules: Sequence[str]) -> None:
    """Keep a check where every engine imported; a folder that cannot be written just means no reuse."""
    from prefect_accelerate.launchers.state import write_private_json

    try:
        write_private_json(_reuse_path(key), {"checked_at": time.time(), "modules": list(modules)}, "cache folder")
    except Exception:  # noqa: BLE001 - reuse is an optimisation, never a failure of the probe
        pass


class ImportCheck:
    """The running child that imports the installed engines; `results()` waits for it.

    Use it as a context manager (or call `close()`) so the child never outlives the probe.
    """

    def __init__(
        self,
        engines: Sequence[EngineSpec] = OPTIONAL_ENGINES,
        *,
        check_imports: bool = True,
        timeout: float = IMPORT_CHECK_TIMEOUT_S,
    ) -> None:
        self.engines = tuple(engines)
        self.timeout = timeout
        self._installed = {spec.module: _installed(spec) for spec in self.engines}
        #: the installed engines, which the child imports
        self._wanted = sorted(spec.module for spec in self.engines if self._installed[spec.module][0])
        to_import = [json.dumps([spec.module, *spec.statements]) for spec in self.engines if self._installed[spec.module][0]]
        self._process: subprocess.Popen[str] | None = None
        self._start_error: str | None = None
        self._checked = check_imports
        #: when the result comes from an earlier check (seconds since the epoch), else None
        self.reused_from: float | None = None
        self._reused: dict[str, tuple[bool, str | None]] | None = None
        self._key: str | None = None
        if check_imports and to_import and _reuse_on():
            self._key = _reuse_key(to_import, self._installed)
            kept = _read_reused(self._key)
            if kept is not None and sorted(kept[1]) == self._wanted:
                self.reused_from, self._reused = kept
        if check_imports and to_import and self._reused is None:
            try:
                self._process = subprocess.Popen(
                    [sys.executable, "-c", _CHILD, *to_import],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    text=True, errors="replace",
                )
            except OSError as error:
                self._start_error = f"the import check could not start {sys.executable}: {error}"

    def __enter__(self) -> ImportCheck:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.communicate()

    def results(self) -> list[EngineProbe]:
        """Wait for the child (up to the timeout) and return one probe per engine, in table order."""
        imported: dict[str, tuple[bool, str | None]] = {}
        # (importable, why) for the engine the child was busy with when it stopped
        failure: tuple[bool | None, str] | None = None if self._start_error is None else (None, self._start_error)
        if self._reused is not None:
            imported = dict(self._reused)
        if self._process is not None:
            try:
                stdout, stderr = self._process.communicate(timeout=self.timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                self._process.kill()
                stdout, stderr = self._process.communicate()
                timed_out = True
            for line in stdout.splitlines():
                try:
                    item = json.loads(line)
                    imported[item["module"]] = (bool(item["ok"]), item["error"])
                except (ValueError, KeyError, TypeError):
                    continue
            if timed_out:  # slow is not broken: say so, without a verdict
                failure = (None, f"the import did not finish within {self.timeout:g} s")
            elif self._process.returncode != 0:
                code = self._process.returncode
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                last = (stderr.strip().splitlines() or [""])[-1][:200]
                failure = (False, f"the Python process importing it {how}" + (f" ({last})" if last else ""))
            elif self._key is not None and sorted(imported) == self._wanted and all(ok for ok, _ in imported.values()):
                _keep(self._key, self._wanted)
        probes: list[EngineProbe] = []
        blamed = False
        for spec in self.engines:
            installed, version = self._installed[spec.module]
            if not installed:
                probes.append(EngineProbe(spec.module, False, version, False))
            elif spec.module in imported:
                ok, error = imported[spec.module]
                probes.append(EngineProbe(spec.module, True, version, ok, error))
            elif not self._checked:
                probes.append(EngineProbe(spec.module, True, version, None))
            elif failure is not None and not blamed:
                # the first engine without a result is the one the child was importing when it stopped
                blamed = True
                probes.append(EngineProbe(spec.module, True, version, failure[0], failure[1]))
            else:
                probes.append(EngineProbe(spec.module, True, version, None, "not checked: an earlier import stopped the check"))
        return probes
