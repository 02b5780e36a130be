"""What every row does with its loader: read it for a window, time every wait, and check each batch's
samples by content against the generated dataset (:class:`Fingerprints`, :func:`drain`)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

__all__ = ["SAMPLE_BYTES", "Fingerprints", "drain"]

#: A sample of the generated dataset: float32 3×32×32 and an int64 label.
SAMPLE_BYTES = 3 * 32 * 32 * 4 + 8


class Fingerprints:
    """Which sample a row of a batch is, from its first 8 bytes; a batch checks when every row is a
    sample of the dataset, with its own label and (for one row per batch) all its bytes."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        self.x, self.y = x, y
        keys = np.ascontiguousarray(x.reshape(len(x), -1)[:, :2]).view(np.int64).ravel()
        self.order = np.argsort(keys, kind="stable")
        self.keys = keys[self.order]

    def check(self, bx: np.ndarray, by: np.ndarray, where: str) -> None:
        keys = np.ascontiguousarray(bx.reshape(len(bx), -1)[:, :2]).view(np.int64).ravel()
        pos = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        idx = self.order[pos]
        if not np.array_equal(self.keys[pos], keys) or not np.array_equal(self.y[idx], by):
            raise RuntimeError(f"{where}: a batch holds samples (or labels) that are not the dataset's")
        if not np.array_equal(self.x[idx[-1]], bx[-1]):
            raise RuntimeError(f"{where}: sample {idx[-1]} arrived with other bytes than the dataset's")


def _arrays(batch: Any) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(batch, dict):  # Streaming's samples, collated: {"x": tensor, "y": tensor}
        return batch["x"].numpy(), batch["y"].numpy()
    x, y = batch
    return x.numpy(), y.numpy()


def drain(
    make: Iterable,
    seconds: float,
    where: str,
    check: Fingerprints | None,
    step_s: float = 0.0,
    warmup: int = 0,
    settle_s: float = 0.0,
) -> dict[str, Any]:
    """Read passes of ``make`` (a loader) back to back for ``seconds``, timing every wait; with
    ``step_s``, sleep that long after each batch (a training step that leaves the cores free). With
    ``settle_s``, read that long first, checked but not counted: a loader that sizes its window
    (``inflight=None``, :mod:`libbus.loader.window_size`) has grown it by then, as in the hours of a job.

    The rate counts from the first batch to the last; with ``warmup`` (the loader's batches in flight), from
    batch ``warmup + 1`` on: the batches asked for together at the start arrive nearly together, their bytes
    mostly moved before the first one arrived, and counting them against the time after it counts bytes
    twice over (a link's rate came out above its cap). The row then also says the window's ends in
    ``time.monotonic()`` (``window``), for a link counter read by another process."""
    waits: list[float] = []
    stamps: list[float] = []
    samples: list[int] = []
    start = time.perf_counter()
    counted_from = start + settle_s
    deadline = counted_from + seconds
    it: Iterator | None = None
    read = 0  # every batch, the settling ones included (a store's requests per batch count them all)
    while time.perf_counter() < deadline:
        if it is None:
            it = iter(make)
        t = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            it = None
            continue
        now = time.perf_counter()
        read += 1
        bx, by = _arrays(batch)
        if check is not None:
            check.check(bx, by, where)
        if now >= counted_from:
            waits.append(now - t)
            stamps.append(now)
            samples.append(len(bx))
        del batch, bx, by
        if step_s:
            time.sleep(step_s)
    del it
    if not stamps:
        raise RuntimeError(f"{where}: no batch within {seconds:g} s")
    row: dict[str, Any] = {"batches": len(stamps), "read": read, "first_s": stamps[0] - start}
    if settle_s:
        row["settle_s"] = settle_s
    if warmup and len(stamps) >= warmup + 3:  # steady state: as many batches in flight at both ends
        rate = sum(samples[warmup + 1 :]) / (stamps[-1] - stamps[warmup])
        to_mono = time.monotonic() - time.perf_counter()
        row.update(window=(stamps[warmup] + to_mono, stamps[-1] + to_mono), warmup_batches=warmup)
    elif len(stamps) >= 3:  # from the first batch to the last: start-up (connections, pipeline fill) apart
        if warmup:
            row["note"] = f"fewer than {warmup + 3} batches: the first batches' bytes are counted in the rate"
        rate = sum(samples[1:]) / (stamps[-1] - stamps[0])
    else:  # too few batches for that: the whole window, start-up included
        rate = sum(samples) / (stamps[-1] - counted_from)
        row["note"] = "start-up included (under 3 batches)"
    ms = np.array(waits[1:] or waits) * 1e3
    row.update(
        samples_per_s=rate,
        mb_per_s=rate * SAMPLE_BYTES / 1e6,
        p50_ms=float(np.percentile(ms, 50)),
        p99_ms=float(np.percentile(ms, 99)),
        max_ms=float(ms.max()),
    )
    return row
