"""The distributed self-test (`prefect-accelerate test`): launch options for it and the report it prints.

The script itself (selftest/script.py) runs on every launched process with only torch; here is what
the launching side needs: where the script is, and how to read its `[selftest]` lines back.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

SCRIPT = Path(__file__).resolve().parent / "script.py"
_LINE = re.compile(r"\[selftest\] (?P<kind>PASS|FAIL|START|SUCCESS|FAILED)\s*(?P<rest>.*)")


class SelfTestCheck(BaseModel):
    name: str
    passed: bool
    detail: str
    ranks: list[int] = Field(default_factory=list)


class SelfTestReport(BaseModel):
    """What the self-test found, read from rank 0's output."""

    checks: list[SelfTestCheck] = Field(default_factory=list)
    started: str | None = None
    success: bool = False

    def summary(self) -> str:
        passed = sum(c.passed for c in self.checks)
        return f"{passed}/{len(self.checks)} checks passed" + ("" if self.success else "; the self-test FAILED")

    def markdown(self) -> str:
        lines = [f"# Self-test: {'passed' if self.success else 'FAILED'}", ""]
        if self.started:
            lines += [f"Started on {self.started}.", ""]
        lines += ["| check | result | detail |", "|---|---|---|"]
        for check in self.checks:
            where = f" (rank {', '.join(map(str, check.ranks))})" if check.ranks else ""
            lines.append(f"| {check.name} | {'pass' if check.passed else 'FAIL' + where} | {check.detail.replace('|', '/')} |")
        return "\n".join(lines)


def parse_selftest_output(lines: list[str]) -> SelfTestReport:
    report = SelfTestReport()
    for line in lines:
        match = _LINE.search(line)
        if not match:
            continue
        kind, rest = match.group("kind"), match.group("rest")
        if kind == "START":
            report.started = rest
        elif kind == "SUCCESS":
            report.success = True
        elif kind == "PASS":
            name, _, detail = rest.partition(": ")
            report.checks.append(SelfTestCheck(name=name.strip(), passed=True, detail=detail))
        elif kind == "FAIL":
            head, _, detail = rest.partition(": ")
            name, _, ranks = head.partition(" on rank(s) ")
            report.checks.append(SelfTestCheck(
                name=name.strip(), passed=False, detail=detail,
                ranks=[int(r) for r in ranks.split(",") if r.strip().isdigit()],
            ))
    return report


def selftest_options(config_file: str | os.PathLike[str] | None = None, **flags: Any):
    """LaunchOptions that run the self-test with `config_file` (and any launch flags) through the real launcher."""
    from prefect_accelerate.launchers.options import build_launch_options

    return build_launch_options(str(SCRIPT), (), config_file=config_file, **flags)
