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
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

#: How long the child may take to import every engine before the rest are reported as unchecked
#: (a loaded 2-core machine needed over 60 s for deepspeed, sagemaker, transformers' config classes and timm).
IMPORT_CHECK_TIMEOUT_S = 120.0


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
import json, os, sys
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
        to_import = [json.dumps([spec.module, *spec.statements]) for spec in self.engines if self._installed[spec.module][0]]
        self._process: subprocess.Popen[str] | None = None
        self._start_error: str | None = None
        self._checked = check_imports
        if check_imports and to_import:
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
