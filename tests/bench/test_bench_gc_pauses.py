"""The garbage-collection benchmark (:mod:`benchmarks.gc_pauses`) runs end to end in its quickest form: one
provider with ``gc_freeze`` off and one with it on, each read with both shuffles (samples checked by
content), each provider's full collections read from its /metrics. Correctness only: no timing is judged."""

import json
import subprocess
import sys

from tests.support.busctl import REPO


def test_gc_bench_reads_a_provider_with_and_without_the_freeze(tmp_path):
    out = tmp_path / "gc.json"
    args = ["--samples", "1024", "--seconds", "0.3", "--repeat", "1", "--json", str(out)]
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.gc_pauses", *args], cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0, run.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [r["gc_freeze"] for r in runs] == [False, True]
    off, on = runs
    assert off["frozen_objects"] == 0 and on["frozen_objects"] > 10_000
    for r in runs:
        assert r["block"]["batches"] >= 1 and r["full"]["batches"] >= 1
        assert set(r["full_collections"]) == {"collections", "ms", "each_at_most_ms"}
        assert r["hello_max_ms"] > 0
    assert run.stdout.count("gc_freeze=") == 2


def test_gc_bench_refuses_bad_options():
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.gc_pauses", "--repeat", "0"], cwd=REPO, capture_output=True, text=True
    )
    assert run.returncode == 2 and "must be positive" in run.stderr and "Traceback" not in run.stderr
