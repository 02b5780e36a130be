"""A read helper's batches go through memory files that are kept and reused between reads (a new one per
batch cost both processes a page fault per 4 KiB): every batch read so is the source's own bytes, whatever
size the batch before it was, alongside other reads, after a failed one; and the files kept stay bounded."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from libbus.errors import BusError
from services.provider.read_helper import ReadHelper


def _memory_files() -> int:
    """The anonymous memory files this process holds open (a file and its mapping's own descriptor: one)."""
    files = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "batchbus-read" in os.readlink(f"/proc/self/fd/{fd}"):
                files.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:  # closed meanwhile
            pass
    return len(files)


@pytest.fixture
def helper(tmp_path):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((300, 3, 5)).astype(np.float32)
    y = rng.integers(0, 10, 300).astype(np.int64)
    np.save(tmp_path / "train_x.npy", x)
    np.save(tmp_path / "train_y.npy", y)
    h = ReadHelper("disk", f"file://{tmp_path}?memory=stream&val_fraction=0", threads=2)
    h.start()
    try:
        yield h, x, y
    finally:
        h.close()


def _read(h: ReadHelper, idx: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # filled with what no sample holds: a byte the helper did not write would show
    bx = np.full((len(idx), *x.shape[1:]), np.nan, np.float32)
    by = np.full(len(idx), -1, np.int64)
    h.serve_into("train", idx, bx, by)
    return bx, by


def test_batches_of_every_size_read_through_reused_memory_files_are_the_sources_bytes(helper):
    h, x, y = helper
    rng = np.random.default_rng(1)
    sizes = [64, 3, 64, 40, 1, 64, 33, 64, 2, 50] * 3  # large then small: a kept file larger than the batch

    def one(n: int) -> None:
        idx = rng.choice(len(x), n, replace=False).astype("<i8")
        bx, by = _read(h, idx, x)
        assert np.array_equal(bx, x[idx]) and np.array_equal(by, y[idx]), n

    with ThreadPoolExecutor(2) as pool:  # two at once, as the helper's threads read them
        list(pool.map(one, sizes))
    assert _memory_files() <= h.threads, "memory files were kept beyond the batches a helper reads at once"


def test_a_failed_read_leaves_the_next_reads_right_and_closing_keeps_no_file(helper):
    h, x, y = helper
    idx = np.array([5, 299, 0], "<i8")
    _read(h, idx, x)
    with pytest.raises(BusError):
        _read(h, np.array([1, 10_000], "<i8"), x)  # past the split's end: refused in the helper
    for _ in range(3):
        bx, by = _read(h, idx, x)
        assert np.array_equal(bx, x[idx]) and np.array_equal(by, y[idx])
    h.close()
    assert _memory_files() == 0, "a closed helper's memory files stayed open"
