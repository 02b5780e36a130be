"""Reading one pass of a loader back, and checking it against the order it promised (the replica and
flow tests: every sample of the split exactly once, in order, whatever failed on the way)."""

from __future__ import annotations

import numpy as np

from libbus.loader.remote import RemoteLoader
from services.provider.sources import open_source

#: The split those tests read, and the samples it holds.
URI = "mock://mnist?n=600"
SOURCE = open_source(URI)


def read_epoch(loader: RemoteLoader, it=None, on_batch=None) -> tuple[np.ndarray, np.ndarray]:
    """One pass, copied out of the loader (same-host tensors view a ring slot)."""
    xs, ys = [], []
    for i, (x, y) in enumerate(it if it is not None else loader):
        xs.append(x.numpy().copy())
        ys.append(y.numpy().copy())
        if on_batch is not None:
            on_batch(i)
    return np.concatenate(xs), np.concatenate(ys)


def assert_exact_epoch(loader: RemoteLoader, epoch: int, x: np.ndarray, y: np.ndarray) -> None:
    """Every sample of the split exactly once, in the loader's order for ``epoch``."""
    order = loader.order(epoch)
    want_x, want_y = SOURCE.read("train", order)
    assert len(x) == len(order) == SOURCE.num_samples("train")
    assert np.array_equal(y, want_y) and np.array_equal(x, want_x)
