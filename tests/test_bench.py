"""`busctl bench` runs end to end on a small dataset: every row measured, ratios and checks reported."""

import json

import pytest

from tests.support import busctl


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
        "--json",
        str(out),
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = {r["path"]: r for r in result["rows"]}
    assert {"memcpy", "dataloader", "pyzmq", "shm", "shm-stream", "socket"} <= set(rows)
    for row in rows.values():
        assert row["samples_per_s"] > 0 and row["p99_ms"] >= row["p50_ms"] > 0
    assert rows["dataloader"]["x_dataloader"] == 1.0 and rows["memcpy"]["x_memcpy"] == 1.0
    assert {c["check"] for c in result["checks"]} >= {
        "shm vs DataLoader (samples/s)",
        "shm vs memcpy (GB/s)",
        "socket vs raw pyzmq (GB/s)",
    }
    assert [r["path"] for r in result["wait"]["rows"]] == ["shm", "socket", "dataloader"]
    assert "× DataLoader" in run.stdout


def test_bench_rejects_a_dataset_too_small_for_its_batches(tmp_path):
    run = busctl("bench", "--samples", "100")
    assert run.returncode == 2 and "--samples must be at least" in run.stderr
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
