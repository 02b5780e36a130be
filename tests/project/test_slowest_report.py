"""The end of ``make test`` (tests/support/slowest.py): the slowest tests across both pytest runs, and totals
that count a failure, an error and a skip as pytest does."""

from __future__ import annotations

import subprocess
import sys

from tests.support.slowest import main


def test_the_slowest_across_both_reports_and_the_totals(tmp_path, capsys):
    # two real pytest runs of a small file, as make test's two parts write them
    (tmp_path / "test_some.py").write_text(
        "import time, pytest\n"
        "def test_slow():\n    time.sleep(0.3)\n"
        "def test_fails():\n    assert False\n"
        "@pytest.mark.skip(reason='x')\ndef test_skipped():\n    pass\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('set-up')\n"
        "def test_errors(broken):\n    pass\n"
    )
    (tmp_path / "test_more.py").write_text("def test_quick():\n    pass\n")
    for name in ("some", "more"):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                f"test_{name}.py",
                f"--junitxml={name}.xml",
            ],
            cwd=tmp_path,
            capture_output=True,
            check=False,
        )
    assert main([str(tmp_path / "some.xml"), str(tmp_path / "more.xml"), "--top", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if "::" in line]
    assert len(rows) == 2 and rows[0].strip().endswith("test_some.py::test_slow")
    assert out[-1] == "2 passed, 2 failed, 1 skipped"  # the error counts as failed, as CI reads it


def test_a_missing_report_is_said_and_the_rest_still_counted(tmp_path, capsys):
    assert main([str(tmp_path / "absent.xml")]) == 0
    captured = capsys.readouterr()
    assert "absent.xml" in captured.err and "no test in the reports" in captured.out
