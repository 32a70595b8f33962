"""Numbers and lists in the docs that the code decides, held equal to the code (issue 28): the deployments
deployments/prefect.yaml registers, the CLI's subcommands and their tracking defaults, every
`prefect-accelerate ...` line the README shows (it must parse with the real parser), and the files the docs cite."""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from pathlib import Path

import pytest
import yaml

from prefect_accelerate.cli.main import build_parser

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
DEPLOY_README = (REPO / "deployments" / "README.md").read_text()
DOCS = [REPO / "README.md", REPO / "deployments" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def section(text: str, heading: str) -> str:
    """The text under the first heading that starts with `heading`, up to the next heading of the same level."""
    match = re.search(rf"^(#+) {re.escape(heading)}.*$", text, re.M)
    assert match, heading
    level = len(match.group(1))
    rest = text[match.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[: end.start()] if end else rest


def flow_name(entrypoint: str) -> str:
    """The @flow(name=...) of an entrypoint `path.py:function`, read from its source."""
    path, function = entrypoint.split(":")
    tree = ast.parse((REPO / path).read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    for decorator in node.decorator_list:
        if isinstance(decorator, ast.Call) and getattr(decorator.func, "id", "") == "flow":
            for keyword in decorator.keywords:
                if keyword.arg == "name":
                    return keyword.value.value
    return function.replace("_", "-")  # Prefect's default flow name


def deployments() -> list[str]:
    """Every deployment of the project's prefect files: deployments/prefect.yaml and the per-pool files beside it
    (deployments/kubernetes/prefect.yaml)."""
    names = []
    for path in [REPO / "deployments" / "prefect.yaml", *sorted((REPO / "deployments").glob("*/prefect.yaml"))]:
        spec = yaml.safe_load(path.read_text())
        names += [f"{flow_name(d['entrypoint'])}/{d['name']}" for d in spec["deployments"]]
    return names


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    return dict(action.choices) if action else {}


def test_the_deployments_table_lists_exactly_what_prefect_yaml_registers():
    # the deployment table's rows: a name, then an entrypoint `path.py:function` (other tables list files)
    rows = re.findall(r"^\| `([^`]+)` \| `[^`]+\.py:\w+` \|", DEPLOY_README, re.M)
    assert sorted(rows) == sorted(deployments())


def test_no_doc_states_a_deployment_count_that_differs_from_prefect_yaml():
    words = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}
    for text in (README, DEPLOY_README):
        for said in re.findall(r"registers (\w+) deployments", text):
            if said not in words and not said.isdigit():
                continue  # "registers its deployments": no number to drift
            assert words.get(said, said) in (len(deployments()), str(len(deployments()))), said


def test_the_readme_names_every_deployment():
    for name in deployments():
        assert f"`{name}`" in README or f"`{name.split('/')[1]}` in deployments/prefect.yaml" in README, name


def test_every_subcommand_has_its_place_in_the_readmes_commands():
    """Each subcommand is shown as `prefect-accelerate <name>` in a code block of the README."""
    shown = {line.split()[1] for line in readme_command_lines()}
    assert set(subparsers(build_parser())) <= shown, set(subparsers(build_parser())) - shown


def test_the_tracked_or_not_table_gives_each_commands_real_default():
    table = section(README, "Tracked or not")
    rows = {}
    for cells in re.findall(r"^\| (.+?) \| (tracked|direct|never) \|", table, re.M):
        for name in re.findall(r"`([^`]+)`", cells[0]):
            rows[name] = "direct" if cells[1] == "never" else cells[1]  # never: it only prints, so not tracked by default
    for name, sub in subparsers(build_parser()).items():
        default = sub.get_default("tracked_by_default")
        if default is None:
            continue  # no --track/--no-track (server)
        assert rows.get(name) == ("tracked" if default else "direct"), (name, rows.get(name))


def readme_command_lines() -> list[str]:
    """Every `prefect-accelerate ...` line of the README's code blocks (continuations joined, comments and pipes cut)."""
    lines = []
    for block in re.findall(r"```(?:bash)?\n(.*?)```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].split(" | ")[0].strip()
            if line.startswith("prefect-accelerate "):
                lines.append(line)
    return lines


@pytest.mark.parametrize("line", readme_command_lines())
def test_every_command_the_readme_shows_parses_with_the_real_parser(line):
    """Flags and subcommands in the README exist, with the spelling shown (`...` and `[optional]` marks dropped)."""
    argv = [token.strip("[]") for token in shlex.split(line)[1:] if token != "..."]
    if "..." in line and argv[0] in ("launch", "pipeline") and not any(t.endswith(".py") for t in argv):
        argv.append("train.py")  # an elided line keeps its flags; the script stands where the elision was
    try:
        build_parser().parse_args(argv)
    except SystemExit as stop:
        pytest.fail(f"the README's `{line}` does not parse (exit {stop.code})")


def test_the_docs_cite_no_file_that_is_not_in_the_repository():
    """Relative links, and backticked paths under the repository's own folders, point at files that exist."""
    roots = ("docs/", "deployments/", "examples/", "bench/", "tests/", "prefect_accelerate/", "reference/", ".ci/")
    for doc in DOCS:
        text = doc.read_text()
        cited = [target.split("#")[0] for target in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in target and not target.startswith("#")]
        cited += re.findall(r"\b((?:reference|docs)/[\w.-]+\.md)\b", text)  # a citation in prose, e.g. "(reference/x.md §2)"
        cited += [p for p in re.findall(r"`([\w./-]+)`", text) if p.startswith(roots) and not any(c in p for c in "*<") and not p.endswith(".")]
        for target in cited:
            base = doc.parent if not target.startswith(roots) else REPO
            path = (base / target) if (base / target).exists() else (REPO / target)
            assert path.exists(), f"{doc.relative_to(REPO)} cites {target}, which is not in the repository"


def test_run_folders_follow_xdg_cache_home_as_the_readme_says(tmp_path, monkeypatch):
    from prefect_accelerate.launchers.state import STATE_ENV, new_run_dir

    monkeypatch.delenv(STATE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert new_run_dir().parent == tmp_path / "xdg" / "prefect-accelerate" / "runs"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert new_run_dir().parent == Path("~/.cache/prefect-accelerate/runs").expanduser()
    monkeypatch.setenv(STATE_ENV, str(tmp_path / "state"))
    assert new_run_dir().parent == tmp_path / "state" / "runs"
    assert "`$XDG_CACHE_HOME/prefect-accelerate/runs` (`~/.cache/prefect-accelerate/runs` when `XDG_CACHE_HOME` is unset;" in README


def test_the_readme_states_no_test_count_that_no_test_keeps():
    assert not re.search(r"\b\d{3,} tests\b", README)
