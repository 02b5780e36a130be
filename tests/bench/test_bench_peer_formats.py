"""`busctl bench --peers`: the rows of the formats users bring (benchmarks/peer_formats.py), each peer's files
written by its own writer and read by its own loader and by batchbus, every batch checked; tensor only."""

import json

import pytest

from tests.support import busctl

ROWS = ["tfrecord", "shm-tfrecord", "hf-disk", "shm-hf-disk", "shm-mds", "shm-litdata"]


@pytest.mark.timeout(300)
def test_each_format_is_read_by_its_own_loader_and_by_batchbus_from_the_same_files(tmp_path):
    out = tmp_path / "peers.json"
    args = ["--rows", ",".join(ROWS), "--samples", "256", "--batch", "32", "--epochs", "1", "--workers", "1"]
    run = busctl("bench", "--peers", *args, "--json", str(out), timeout=280)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {r["path"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ROWS
    for name, row in rows.items():  # the test extra installs every writer and loader these rows need
        assert row["status"] == "ok", (name, row["status"], row.get("trace", ""))
        assert row["batches"] == 8 and row["samples_per_s"] > 0, name


def test_the_format_rows_are_refused_for_the_images_workload():
    run = busctl("bench", "--peers", "--workload", "images", "--rows", "shm,shm-mds")
    assert run.returncode == 2 and "row(s) shm-mds read the tensor workload only" in run.stderr
    assert "Traceback" not in run.stderr
