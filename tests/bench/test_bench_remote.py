"""The remote-data benchmark (:mod:`benchmarks.remote`) runs end to end in its quickest form: every row
measured (samples checked by content inside it), the head-of-line part and its probes reported.
Correctness only: timings are the benchmark's business, not this test's."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from benchmarks.remote.cluster import FullCollections
from benchmarks.remote.head_of_line import cores_of, place, tenant_cores
from tests.support.busctl import REPO

MOSAIC = importlib.util.find_spec("streaming") is not None


def test_remote_bench_measures_every_row_and_writes_json(tmp_path):
    out = tmp_path / "remote.json"
    args = ["--quick", "--latency-ms", "0,10", "--shuffles", "block", "--seconds", "0.3", "--samples", "1024"]
    args += ["--settle-s", "0.2", "--hol-latency-ms", "10", "--hol-seconds", "0.3", "--json", str(out)]
    if not MOSAIC:
        args.append("--no-mosaic")
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.remote", *args], cwd=REPO, capture_output=True, text=True, timeout=280
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {(r["path"], r.get("latency_ms")): r for r in result["rows"]}
    want = {("file", None)} | {(path, ms) for path in ("http", "mosaic", "s3-mds") for ms in (0.0, 10.0)}
    if not MOSAIC:
        want = {(path, ms) for path, ms in want if path not in ("mosaic", "s3-mds")}
    assert set(rows) == want
    for key, row in rows.items():
        assert "error" not in row, (key, row)
        assert row["batches"] >= 1 and row["samples_per_s"] > 0 and row["mb_per_s"] > 0, (key, row)
        assert row["p99_ms"] >= row["p50_ms"] >= 0, (key, row)
        assert row["settle_s"] == 0.2, (key, row)  # read uncounted first
        assert row["read"] >= row["batches"], (key, row)  # a store's GETs per batch count the settling ones too
        if key[0] != "mosaic":
            assert row["inflight_at_end"] >= 1, (key, row)
        if key[0] != "mosaic":  # the same shuffle as a file row: its ratio to it
            assert row["x_file"] > 0, (key, row)
        if key[0] != "file":  # read from the store: it answered GETs (the file row asked it nothing)
            assert row["gets_per_batch"] > 0, (key, row)
    if MOSAIC:
        assert rows[("s3-mds", 10.0)]["x_mosaic"] > 0
    hol = result["head_of_line"]
    for part in ("alone", "beside", "apart"):  # apart: the slow dataset on a provider of its own, the control
        assert hol[part]["samples_per_s"] > 0 and hol[part]["p99_ms"] > 0
    for slow in ("slow_loader", "slow_loader_apart"):
        assert "error" not in hol[slow] and hol[slow]["batches"] >= 1, hol[slow]
    assert hol["p99_shared_over_apart"] == hol["beside"]["p99_ms"] / hol["apart"]["p99_ms"]
    assert hol["probes"] >= 1 and hol["hello_busy_max_ms"] > 0 and hol["info_busy_max_ms"] > 0
    assert "samples/s" in run.stdout and "head-of-line" in run.stdout


def test_remote_bench_hol_only_measures_the_head_of_line_part_alone(tmp_path):
    out = tmp_path / "remote.json"
    args = [
        "--quick",
        "--hol-only",
        "--seconds",
        "0.3",
        "--hol-seconds",
        "0.3",
        "--samples",
        "1024",
        "--hol-latency-ms",
        "10",
        "--hol-busy",
        "1",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.remote", *args, "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["rows"] == []  # no throughput row, no MDS
    hol = result["head_of_line"]
    assert hol["alone"]["batches"] >= 1 and hol["beside"]["batches"] >= 1 and hol["apart"]["batches"] >= 1
    assert hol["probes"] >= 1
    assert "error" not in hol["slow_loader"] and hol["slow_loader"]["batches"] >= 1, hol["slow_loader"]
    assert "head-of-line" in run.stdout and "GETs/batch" not in run.stdout
    assert hol["seconds"] == 0.3
    assert hol["busy_loops"] == 1  # measured beside a deliberate load, which ended with the part
    # the shared provider's full garbage collections beside, read from its /metrics
    assert set(hol["gc_full_beside"]) == {"collections", "ms", "each_at_most_ms"}
    assert "full garbage collections beside" in run.stdout
    # the store and the other loaders ran on the last core, as other machines: every thread of theirs
    mine = sorted(os.sched_getaffinity(0))
    tenants = mine[-1:] if len(mine) > 1 else None
    assert hol["tenant_cores"] == tenants
    assert hol["store_cores"] == (tenants or mine)
    for slow in ("slow_loader", "slow_loader_apart"):
        assert hol[slow]["cores"] == (tenants or mine), hol[slow]


def test_full_collections_are_counted_between_two_readings():
    inf = float("inf")
    earlier = FullCollections([(0.0001, 1), (0.001, 2), (0.025, 2), (inf, 2)], 0.0012)
    later = FullCollections([(0.0001, 1), (0.001, 4), (0.025, 5), (inf, 5)], 0.0312)
    assert later.since(earlier) == {"collections": 3, "ms": pytest.approx(30.0), "each_at_most_ms": 25.0}
    assert earlier.since(earlier) == {"collections": 0, "ms": 0.0, "each_at_most_ms": 0.0}


def test_tenant_cores_are_the_last_core_unless_shared():
    mine = sorted(os.sched_getaffinity(0))
    assert tenant_cores(share=True) is None
    assert tenant_cores(share=False) == (mine[-1:] if len(mine) > 1 else None)


def test_place_moves_every_thread_of_a_process_and_those_it_starts_later():
    """A running process with threads of its own: placed on one core, every thread is there, and so is
    a thread it starts afterwards; placed back, every thread may run anywhere again."""
    mine = sorted(os.sched_getaffinity(0))
    code = (
        "import sys, threading, time\n"
        "for _ in range(3): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('up', flush=True)\n"
        "sys.stdin.readline()\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('more', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        assert len(os.listdir(f"/proc/{child.pid}/task")) >= 4
        place(child.pid, mine[-1:])
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "more"
        tids = os.listdir(f"/proc/{child.pid}/task")
        assert len(tids) >= 5
        assert {tuple(sorted(os.sched_getaffinity(int(t)))) for t in tids} == {tuple(mine[-1:])}
        assert cores_of(child.pid) == mine[-1:]
        place(child.pid, mine)
        assert cores_of(child.pid) == mine
        assert all(sorted(os.sched_getaffinity(int(t))) == mine for t in os.listdir(f"/proc/{child.pid}/task"))
    finally:
        child.kill()
        child.wait()


BAD_OPTIONS = [
    ["--latency-ms", "10,x"],
    ["--shuffles", "none"],
    ["--samples", "100"],
    ["--hol-only", "--no-hol"],
    ["--hol-busy", "-1"],
    ["--hol-busy", "1000"],  # a thousand spinning processes would starve the machine, not load it
    ["--quick", "--htb-ram-cache", "999999999"],  # holds the whole dataset: RAM would be measured, not the link
    ["--htb-inflight", "-1"],  # 0 leaves the window to the loader; fewer is nothing
    ["--settle-s", "-1"],
    ["--hol-seconds", "-1"],
    ["--htb-inflight", "1000"],  # 3 GB of batches held in the loader
]


@pytest.mark.parametrize("bad", BAD_OPTIONS)
def test_remote_bench_refuses_bad_options(bad):
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.remote", *bad], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2 and "error:" in run.stderr
