"""`busctl bench --peers --workload images`: JPEGs decoded and augmented in every row, rows written as JSON."""

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from benchmarks.peer_jpeg import CLASSES, MEAN, STD, Augment, make_jpegs
from benchmarks.peers import add_ratios, best_of, parse
from tests.support import busctl


@pytest.mark.timeout(180)
def test_images_workload_decodes_in_a_dataloader_and_on_a_provider(tmp_path):
    """Two rows (the batched DataLoader in-process, batchbus's shm ring from a provider
    running the ImageNet train pipeline), tiny JPEGs, two passes of four batches read back to back:
    every batch checked for its shape, dtype and labels before it counts."""
    out = tmp_path / "peers.json"
    run = busctl(
        "bench", "--peers", "--workload", "images", "--rows", "dataloader-batched,shm",
        "--samples", "16", "--batch", "4", "--epochs", "2", "--workers", "0",
        "--image-size", "16", "--image-side", "40", "--json", str(out),
        timeout=170,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["workload"] == "images" and result["sample_shape"] == [3, 16, 16]
    assert result["batches"] == 8 and result["warmup"] == 2
    rows = {r["path"]: r for r in result["rows"]}
    assert list(rows) == ["dataloader-batched", "shm"]
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["batches"] == 8 and row["timed_batches"] == 6  # both passes, the first two untimed
        assert row["samples_per_s"] > 0 and row["cpu_s_per_1k"] >= 0 and row["cores"] >= 0
    assert rows["dataloader-batched"]["x_dataloader_batched"] == 1.0 and rows["shm"]["x_dataloader_batched"] > 0
    assert "workload images" in run.stdout


def test_the_recipe_serves_normalized_crops_of_varied_images(tmp_path):
    """The generated JPEGs come in several sizes and every class; the recipe crops any of them to
    the asked size and normalizes with ImageNet's statistics (a flat grey image lands on -mean/std)."""
    files = make_jpegs(tmp_path, 8, side=64)
    sizes = {Image.open(p).size for p, _ in files}
    assert len(sizes) > 1 and {label for _, label in files} == set(range(CLASSES))
    augment = Augment(12)
    for path, _ in files:
        x = augment(path.read_bytes(), str(path))
        assert x.shape == (3, 12, 12) and x.dtype == np.float32 and np.isfinite(x).all()
    grey = tmp_path / "grey.png"
    Image.new("RGB", (30, 20), (128, 128, 128)).save(grey)
    x = augment(grey.read_bytes())
    np.testing.assert_allclose(x, np.broadcast_to((128 - MEAN) / STD, x.shape), rtol=1e-5)


def test_values_no_row_can_run_are_refused_in_one_line():
    run = busctl("bench", "--peers", "--workload", "video")
    assert run.returncode == 2 and "invalid choice: 'video'" in run.stderr and "Traceback" not in run.stderr
    for argv in (
        ["--workload", "images", "--image-size", "0"],
        ["--workload", "images", "--samples", "100", "--batch", "64"],
        ["--workload", "images", "--epochs", "0"],
        ["--rounds", "0"],
        ["--rows", "shm,ray"],
    ):
        with pytest.raises(SystemExit) as refused:
            parse(["--peers", *argv])
        assert refused.value.code == 2
    args = parse(["--peers", "--workload", "images"])
    assert (args.samples, args.batch, args.image_size) == (1024, 64, 224)
    assert (parse(["--peers"]).samples, parse(["--peers"]).batch) == (16384, 256)


def test_rounds_keep_each_rows_fastest_and_list_them_all():
    failed = {"path": "shm", "status": "failed: no result within 300 s"}
    runs = [
        {"path": "shm", "status": "ok", "samples_per_s": 300.0, "cpu_s_per_1k": 3.0},
        failed,
        {"path": "shm", "status": "ok", "samples_per_s": 400.0, "cpu_s_per_1k": 2.8},
    ]
    row = best_of(runs)
    assert row["samples_per_s"] == 400.0 and row["cpu_s_per_1k"] == 2.8
    assert row["rounds_samples_per_s"] == [300.0, None, 400.0] and row["rounds_cpu_s_per_1k"] == [3.0, None, 2.8]
    assert best_of([failed, failed]) == failed


def test_ratios_to_the_batched_dataloader_in_wall_time_and_in_cpu():
    rows = [
        {"path": "dataloader-batched", "status": "ok", "samples_per_s": 200.0, "cpu_s_per_1k": 3.0},
        {"path": "shm", "status": "ok", "samples_per_s": 300.0, "cpu_s_per_1k": 2.5},
        {"path": "socket", "status": "ok", "samples_per_s": 100.0, "cpu_s_per_1k": 0.0},  # under a tick
        {"path": "mosaic", "status": "not installed (make install-bench)"},
    ]
    add_ratios(rows)
    base, shm, socket, mosaic = rows
    assert base["x_dataloader_batched"] == 1.0 and base["x_dataloader_batched_per_cpu"] == 1.0
    assert shm["x_dataloader_batched"] == 1.5 and shm["x_dataloader_batched_per_cpu"] == 1.2
    assert socket["x_dataloader_batched"] == 0.5 and "x_dataloader_batched_per_cpu" not in socket
    assert "x_dataloader_batched" not in mosaic


@pytest.mark.timeout(120)
def test_a_row_given_up_leaves_no_process_behind(tmp_path):
    """A row past --row-timeout is killed with everything it started (its router and provider are
    processes of their own), and the run goes on to write its rows."""
    out = tmp_path / "peers.json"
    run = busctl(
        "bench", "--peers", "--workload", "images", "--rows", "shm",
        "--samples", "64", "--batch", "8", "--epochs", "400", "--row-timeout", "8", "--json", str(out),
        env={"TMPDIR": str(tmp_path)}, timeout=100,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"].startswith("failed: no result within 8 s"), row
    time.sleep(0.5)
    assert not [cmd for cmd in _command_lines() if str(tmp_path) in cmd]


def _command_lines() -> list[str]:
    lines = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return lines
