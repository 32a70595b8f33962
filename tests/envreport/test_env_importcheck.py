"""The import check: a failing, crashing, hanging or chatty import is a line in the report, never our error."""

from __future__ import annotations

import textwrap

import pytest

from prefect_accelerate.envreport.importcheck import EngineSpec, ImportCheck


@pytest.fixture
def fake_packages(tmp_path, monkeypatch):
    """Write tiny packages whose import does one thing each; the child sees them through PYTHONPATH."""

    def write(**bodies: str) -> list[EngineSpec]:
        for name, body in bodies.items():
            (tmp_path / name).mkdir()
            (tmp_path / name / "__init__.py").write_text(textwrap.dedent(body))
        return [EngineSpec(name, name, name) for name in bodies]

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{__import__('os').environ.get('PYTHONPATH', '')}")
    return write


def by_name(probes):
    return {p.module: p for p in probes}


def test_working_and_failing_imports_are_told_apart(fake_packages):
    engines = fake_packages(
        fine_pkg="VALUE = 1\n",
        broken_pkg="raise RuntimeError('operator torchvision::nms does not exist')\n",
    )
    with ImportCheck(engines) as check:
        probes = by_name(check.results())
    assert probes["fine_pkg"].installed and probes["fine_pkg"].importable is True
    assert probes["broken_pkg"].installed and probes["broken_pkg"].importable is False
    assert probes["broken_pkg"].error == "RuntimeError: operator torchvision::nms does not exist"


def test_what_an_import_prints_does_not_confuse_the_results(fake_packages):
    engines = fake_packages(chatty_pkg="import os, sys\nprint('{\"module\": \"x\"', end='')\nos.write(1, b'junk')\nsys.stdout.flush()\n")
    with ImportCheck(engines) as check:
        assert check.results()[0].importable is True


def test_a_crash_blames_the_import_that_was_running_and_leaves_the_rest_unchecked(fake_packages):
    engines = fake_packages(first_pkg="", crash_pkg="import os\nos._exit(3)\n", last_pkg="")
    with ImportCheck(engines) as check:
        probes = by_name(check.results())
    assert probes["first_pkg"].importable is True
    assert probes["crash_pkg"].importable is False and "exited with code 3" in probes["crash_pkg"].error
    assert probes["last_pkg"].importable is None and probes["last_pkg"].error.startswith("not checked")


def test_a_hanging_import_is_reported_after_the_timeout(fake_packages):
    engines = fake_packages(slow_pkg="import time\ntime.sleep(60)\n")
    with ImportCheck(engines, timeout=1.0) as check:
        probe = check.results()[0]
    assert probe.importable is None and "did not finish within 1 s" in probe.error


def test_packages_that_are_not_installed_are_not_imported():
    check = ImportCheck([EngineSpec("surely_not_installed_pkg", "surely-not-installed-pkg", "x")])
    assert check._process is None
    probe = check.results()[0]
    assert (probe.installed, probe.version, probe.importable) == (False, None, False)


def test_without_the_check_nothing_is_imported(fake_packages):
    engines = fake_packages(never_pkg="raise SystemExit('imported')\n")
    check = ImportCheck(engines, check_imports=False)
    assert check._process is None
    assert check.results()[0].importable is None


def test_the_check_imports_what_the_commands_import_and_names_what_breaks(fake_packages, tmp_path):
    """Issue 17: `import transformers` worked while `from transformers import LlamaConfig` failed on a broken
    torchvision, and `env` said "importable". The check runs the commands' own imports and names the culprit."""
    fake_packages(vision_pkg="raise RuntimeError('operator torchvision::nms does not exist')\n", lazy_pkg="VERSION = '5'\n")
    (tmp_path / "lazy_pkg" / "models.py").write_text("import vision_pkg\nLlamaConfig = object\n")
    engine = EngineSpec("lazy_pkg", "lazy_pkg", "lazy_pkg", ("from lazy_pkg.models import LlamaConfig",))
    with ImportCheck([engine]) as check:
        probe = check.results()[0]
    assert probe.installed and probe.importable is False
    assert probe.error == (
        "`from lazy_pkg.models import LlamaConfig` fails: RuntimeError: operator torchvision::nms does not exist "
        "(raised while importing vision_pkg)"
    )


def test_transformers_is_checked_through_the_imports_estimate_memory_uses():
    from prefect_accelerate.envreport.importcheck import OPTIONAL_ENGINES

    transformers = next(spec for spec in OPTIONAL_ENGINES if spec.module == "transformers")
    assert any("AutoConfig" in statement for statement in transformers.statements)
    assert any("LlamaConfig" in statement for statement in transformers.statements)


@pytest.fixture
def own_cache(tmp_path_factory, monkeypatch):
    state = tmp_path_factory.mktemp("cache")  # not in the fake packages' folder, which is on the path
    monkeypatch.setenv("PREFECT_ACCELERATE_CACHE_DIR", str(state))
    monkeypatch.delenv("PREFECT_ACCELERATE_IMPORT_CHECK_CACHE", raising=False)
    return state


def test_a_check_where_everything_imported_is_reused_until_the_installation_changes(fake_packages, own_cache, tmp_path):
    engines = fake_packages(fine_pkg="VALUE = 1\n", other_pkg="")
    with ImportCheck(engines) as first:
        assert first._process is not None and first.reused_from is None
        fresh = first.results()
    kept = list((own_cache / "import-check").iterdir())
    assert len(kept) == 1 and oct(kept[0].stat().st_mode & 0o777) == "0o600"
    with ImportCheck(engines) as second:
        assert second._process is None and second.reused_from is not None  # no child: nothing imported
        assert second.results() == fresh
    # a distribution installed next to them changes the folder's entries, so the next check imports again
    (tmp_path / "newly_installed-1.0.dist-info").mkdir()
    with ImportCheck(engines) as third:
        assert third._process is not None and third.reused_from is None
        assert third.results() == fresh


@pytest.mark.parametrize("why", ["failure", "switched off", "damaged file", "other variables"])
def test_a_failure_a_damaged_record_or_the_switch_means_a_real_import(fake_packages, own_cache, monkeypatch, why):
    bodies = {"fine_pkg": "VALUE = 1\n"}
    if why == "failure":
        bodies["broken_pkg"] = "raise RuntimeError('broken')\n"
    engines = fake_packages(**bodies)
    with ImportCheck(engines) as first:
        first.results()
    if why == "switched off":
        monkeypatch.setenv("PREFECT_ACCELERATE_IMPORT_CHECK_CACHE", "0")
    elif why == "damaged file":
        for path in (own_cache / "import-check").iterdir():
            path.write_text('{"checked_at": "soon", "modules": 3')
    elif why == "other variables":
        monkeypatch.setenv("LD_PRELOAD", "")
    with ImportCheck(engines) as again:
        assert again._process is not None and again.reused_from is None, why
        probes = by_name(again.results())
    assert probes["fine_pkg"].importable is True
    if why == "failure":
        assert probes["broken_pkg"].importable is False and not (own_cache / "import-check").exists()


def test_a_ctrl_c_during_the_imports_is_not_a_verdict(fake_packages):
    """Ctrl-C reaches the child with the rest of the terminal's group; it reported "not importable
    (KeyboardInterrupt)" for an engine that imports fine. The parent owns the stop; the child ignores it."""
    engines = fake_packages(interrupted_pkg="import os, signal\nos.kill(os.getpid(), signal.SIGINT)\nVALUE = 1\n")
    with ImportCheck(engines) as check:
        probe = check.results()[0]
    assert probe.importable is True, probe.error
