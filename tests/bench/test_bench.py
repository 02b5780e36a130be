"""`busctl bench` runs end to end on a small dataset: every row measured, ratios and checks reported."""

import json

import pytest

from benchmarks.delivery_report import CHECKS
from tests.support import busctl

THRESHOLDS = {c.name: c.threshold for c in CHECKS}


def test_bench_measures_every_path_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    run = busctl(
        "bench",
        "--samples",
        "1024",
        "--epochs",
        "2",
        "--wait",
        "--wait-steps",
        "5",
        "--work-ms",
        "2",
        "--repeat",
        "2",
        "--json",
        str(out),
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = {r["path"]: r for r in result["rows"]}
    assert {"memcpy", "memcpy-ring", "dataloader", "pyzmq", "shm", "shm-stream", "socket"} <= set(rows)
    # --repeat: every row measured again, each repeat's ratios its own, a target judged by its worst
    assert len(result["repeats"]) == 2 and [r["path"] for r in result["repeats"][1]] == list(rows)
    assert result["repeats"][1][0]["x_memcpy"] == 1.0 and rows["memcpy-ring"]["x_memcpy_ring"] == 1.0
    judged = [c for c in result["checks"] if "values" in c]
    assert {c["check"] for c in judged} == set(THRESHOLDS)
    for check in judged:
        assert len(check["values"]) == 2 and check["ok"] == (min(check["values"]) >= THRESHOLDS[check["check"]])
    summary = {r["path"]: r for r in result["summary"]}
    assert summary["shm"]["x_memcpy"]["min"] == min(
        r["x_memcpy"] for rs in result["repeats"] for r in rs if r["path"] == "shm"
    )
    for row in rows.values():
        assert row["samples_per_s"] > 0 and row["p99_ms"] >= row["p50_ms"] > 0
    assert rows["dataloader"]["x_dataloader"] == 1.0 and rows["memcpy"]["x_memcpy"] == 1.0
    assert {c["check"] for c in result["checks"]} >= {
        "shm vs DataLoader (samples/s)",
        "shm vs memcpy (GB/s)",
        "socket vs raw pyzmq (GB/s)",
    }
    assert [r["path"] for r in result["wait"]["rows"]] == ["shm", "socket", "dataloader"]
    for row in result["wait"]["rows"]:  # next()'s cost per batch, the row that tracks the loop's side
        assert row["next_us"] > 0 and 0 < row["next_cpu_us"]
    assert "next() µs/batch" in run.stdout
    assert "× DataLoader" in run.stdout


def test_bench_rejects_a_dataset_too_small_for_its_batches(tmp_path):
    run = busctl("bench", "--samples", "100")
    assert run.returncode == 2 and "--samples must be at least" in run.stderr
    assert "Traceback" not in run.stderr
    run = busctl("bench", "--repeat", "0")
    assert run.returncode == 2 and "--repeat must be at least 1" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.timeout(240)
def test_bench_peers_writes_a_row_for_every_loader_asked_for(tmp_path):
    """Each row in a process of its own; a peer that is not installed (no `make install-bench`)
    gives a row saying so instead of failing the run."""
    out = tmp_path / "peers.json"
    asked = ["dataloader-batched", "webdataset", "shm"]
    run = busctl(
        "bench",
        "--peers",
        "--rows",
        ",".join(asked),
        "--samples",
        "512",
        "--batch",
        "64",
        "--epochs",
        "1",
        "--workers",
        "1",
        "--json",
        str(out),
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = {r["path"]: r for r in result["rows"]}
    assert list(rows) == asked and result["batches"] == 8
    for name in ("dataloader-batched", "shm"):  # batchbus and torch are always there
        assert rows[name]["status"] == "ok" and rows[name]["batches"] == 8 and rows[name]["samples_per_s"] > 0
    assert rows["dataloader-batched"]["x_dataloader_batched"] == 1.0
    for name in ("webdataset",):
        row = rows[name]
        assert row["status"] == "ok" or row["status"].startswith("not installed"), row["status"]
        if row["status"] == "ok":
            assert row["batches"] == 8 and row["samples_per_s"] > 0


def test_bench_peers_refuses_unknown_rows():
    run = busctl("bench", "--peers", "--rows", "dataloader,ray")
    assert run.returncode != 0 and "unknown row(s) ray" in run.stderr
    assert "Traceback" not in run.stderr
