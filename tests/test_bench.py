"""`busctl bench` runs end to end on a small dataset: every row measured, ratios and checks reported."""

import json

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
