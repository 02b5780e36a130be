"""The end of ``make test``: the ten slowest tests of the whole run, then the run's totals.

``make test`` runs pytest twice (the parallel part, then the tests marked ``serial``), each writing a JUnit
XML report; this reads both, so the slowest tests are listed across the run, where each pytest's own
``--durations`` would list each part apart. A test's seconds are its set-up, call and tear-down together
(what the run waited for it). Growth shows here when it happens: compare with the list in
tests/support/schedule.py, which orders the longest files first.

    python -m tests.support.slowest REPORT.xml [REPORT.xml ...] [--top N]

The last line is the run's totals in the form every CI reads (``N passed, N failed, N skipped``).
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Case", "main", "read_reports"]


@dataclass(frozen=True)
class Case:
    """One test of a report: its pytest node id, seconds, and outcome (passed, failed, error or skipped)."""

    nodeid: str
    seconds: float
    outcome: str


def read_reports(paths: list[Path]) -> list[Case]:
    """Every test case of the JUnit reports at ``paths`` (a missing or unreadable report is skipped, said on stderr)."""
    cases: list[Case] = []
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as err:
            print(f"slowest: {path}: {err}", file=sys.stderr)
            continue
        for case in root.iter("testcase"):
            outcome = "passed"
            for kind in ("failure", "error", "skipped"):
                if case.find(kind) is not None:
                    outcome = {"failure": "failed"}.get(kind, kind)
            file = case.get("classname", "").replace(".", "/")
            cases.append(Case(f"{file}.py::{case.get('name', '?')}", float(case.get("time") or 0.0), outcome))
    return cases


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=10)
    args = p.parse_args(argv)
    cases = read_reports(args.reports)
    if not cases:
        print("slowest: no test in the reports")
        return 0
    print(f"\nthe {min(args.top, len(cases))} slowest tests of this run (seconds: set-up, call and tear-down):")
    for case in sorted(cases, key=lambda c: c.seconds, reverse=True)[: args.top]:
        print(f"{case.seconds:8.1f}  {case.nodeid}")
    counts = {k: sum(c.outcome == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    total = sum(c.seconds for c in cases)
    print(f"all {len(cases)} tests: {total:.0f} s of test time")
    failed = counts["failed"] + counts["error"]
    print(f"{counts['passed']} passed, {failed} failed, {counts['skipped']} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
