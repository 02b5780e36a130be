"""The chaos soak (benchmarks/chaos.py), short: for 15 s a seeded schedule (a fault every 2 s on
average) kills (-9), stops (SIGTERM) and freezes (SIGSTOP/SIGCONT) the router, two provider replicas
and four trainers (shm and socket) while single-trainer jobs and a gang run; afterwards every job succeeded (or failed
for a declared reason), every epoch saw every sample exactly once, nothing was left in /dev/shm.
The 10-minute run and its figures are in docs/operations.md."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.busctl import REPO


@pytest.mark.timeout(600)
def test_a_short_chaos_soak_loses_nothing(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.chaos",
            "--minutes",
            "0.25",
            "--seed",
            "7",
            "--fault-every",
            "2",
            "--state",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=580,
    )
    report = out.stdout + out.stderr
    assert out.returncode == 0, report
    assert "data lost or repeated: 0" in report and "left behind (rings, sockets): 0" in report, report
    assert "undeclared endings: 0" in report and "result: PASS" in report, report
