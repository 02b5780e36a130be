"""One pipeline's two bindings to the provider's :class:`~.store.DecodeCache`: :class:`PrefixCache`, the
samples as they leave the pipeline's deterministic prefix (a chunk's hits answered from the cache, its
misses read by the prefix and stored), and :class:`FinalCache`, the pipeline's final outputs for an epoch
(a batch's hits written into its rows, the rest run through every stage and stored)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .entries import OBJECT_KINDS, Entry, prefix_digest
from .store import DecodeCache

__all__ = ["CachedRows", "FinalCache", "FinalRows", "PrefixCache"]


class CachedRows:
    """A chunk's answer from the cache (``Chunk.cached``): its whole ``indices``, the ``hits`` by
    position, the positions of the ``misses`` the prefix reads, and the keys it ``claimed``."""

    def __init__(self, indices: np.ndarray, hits: dict[int, Entry], cache: DecodeCache):
        self.indices, self.hits, self.cache = indices, hits, cache
        self.misses = np.empty(0, np.intp)
        self.claimed: list[tuple] = []

    def release(self) -> None:
        claimed, self.claimed = self.claimed, []
        if claimed:
            self.cache.release(claimed)


class PrefixCache:
    """One pipeline's view of the provider's :class:`DecodeCache`: keys of ``dataset`` and the digest
    of its first ``length`` stages (its deterministic prefix)."""

    def __init__(self, cache: DecodeCache, dataset: str, stages: list):
        self.cache = cache
        self.dataset = dataset
        self.length = len(stages)
        self.digest = prefix_digest(stages)
        #: What a sample looks like as it leaves the prefix.
        self.spec = stages[-1].spec
        cache.register(dataset)

    def key(self, split: str, index: int) -> tuple:
        return (self.dataset, split, int(index), self.digest)

    def lookup(self, chunk: Any, stop: threading.Event, deadline: float) -> None:
        """Answer what the cache holds of ``chunk`` (a pipeline :class:`~.stages.Chunk`): keep the hits
        in ``chunk.cached`` and leave the misses in ``chunk.indices``, for the prefix to read.

        A sample another chunk is decoding now is waited for (until ``deadline``, monotonic, or
        ``stop``), then taken from the cache, or decoded here if that decode was given up. The samples
        this chunk decodes are claimed (after any waiting: a chunk that holds claims never waits, so
        two chunks never wait on each other) until :meth:`merge` stores them or :meth:`abandon`.
        """
        keys = [self.key(chunk.split, index) for index in chunk.indices.tolist()]
        hits, misses, claimed = self.cache.take(keys, stop, deadline)
        rows = CachedRows(chunk.indices, hits, self.cache)
        rows.claimed, rows.misses = claimed, misses
        self.cache.add_counts(self.dataset, len(hits), len(misses))
        chunk.cached = rows
        chunk.indices = chunk.indices[rows.misses]

    @staticmethod
    def abandon(chunk: Any) -> None:
        """Release ``chunk``'s claims: it failed or was dropped before :meth:`merge`."""
        if isinstance(chunk.cached, CachedRows):
            chunk.cached.release()

    def store(self, split: str, index: int, x: Any, y: Any) -> Entry:
        """Keep sample ``index``'s prefix output; returns the stored entry (copies, not views)."""
        value = np.array(x) if isinstance(x, np.ndarray) else x
        entry = Entry(value, np.array(y))
        self.cache.put(self.key(split, index), entry)
        return entry

    def merge(self, chunk: Any) -> None:
        """After the last prefix stage: store the misses' output, and put the whole chunk back
        together, in request order, for the random stages. A chunk ``lookup`` did not see passes."""
        rows = chunk.cached
        if rows is None:
            return
        try:
            self._merge(chunk, rows)
        finally:
            rows.release()

    def _merge(self, chunk: Any, rows: CachedRows) -> None:
        indices, hits, misses = rows.indices, rows.hits, rows.misses
        n, spec = len(indices), self.spec
        if not hits:  # every row read by the prefix, in order: keep its arrays, store copies
            x, y = chunk.xy()
            for row in range(n):
                self.store(chunk.split, int(indices[row]), x[row], y[row])
            chunk.indices, chunk.cached = indices, None
            return
        rows_x: list = [None] * n
        rows_y: list = [None] * n
        for pos, entry in hits.items():
            rows_x[pos], rows_y[pos] = entry.x, entry.y
        if len(misses):
            x, y = chunk.xy()
            for row, pos in enumerate(misses.tolist()):
                entry = self.store(chunk.split, int(indices[pos]), x[row], y[row])
                rows_x[pos], rows_y[pos] = entry.x, entry.y
        if spec.kind in OBJECT_KINDS:  # images of any size, token lists: one object per sample
            out_x = np.empty(n, object)
            for pos, value in enumerate(rows_x):
                out_x[pos] = value
        else:
            out_x = np.empty((n, *spec.sample_shape), spec.dtype)
            for pos, value in enumerate(rows_x):
                out_x[pos] = value
        out_y = np.empty((n, *spec.label_shape), spec.label_dtype)
        for pos, value in enumerate(rows_y):
            out_y[pos] = value
        chunk.x, chunk.y, chunk.indices = out_x, out_y, indices
        chunk.cached = None


class FinalRows:
    """A batch's answer from the final cache (:meth:`FinalCache.lookup`): the ``hits`` by position, the
    positions of the ``misses`` the pipeline runs, the keys claimed, and the random ``state`` looked up."""

    def __init__(self, cache: DecodeCache, state: str):
        self.cache, self.state = cache, state
        self.hits: dict[int, Entry] = {}
        self.misses = np.empty(0, np.intp)
        self.claimed: list[tuple] = []

    def fill(self, x: np.ndarray, y: np.ndarray) -> None:
        """Write the hits into their rows of ``x`` and ``y``."""
        for pos, entry in self.hits.items():
            x[pos], y[pos] = entry.x, entry.y

    def release(self) -> None:
        claimed, self.claimed = self.claimed, []
        if claimed:
            self.cache.release(claimed)


class FinalCache:
    """One pipeline's final outputs in the provider's :class:`DecodeCache`: keys of ``dataset``, the digest
    of all its ``stages`` and the state (seed, epoch) its ``random`` stages draw from for a request."""

    def __init__(self, cache: DecodeCache, dataset: str, stages: list, random: list):
        self.cache = cache
        self.dataset = dataset
        self.digest = prefix_digest(stages)
        self.random = random
        cache.register(dataset)

    def state(self, epoch: int) -> str:
        """What the random stages draw from for a request of ``epoch``: each one's seed and epoch (a
        pinned one, or the request's), as they are now (control commands change them)."""
        return ";".join(f"{s.seed}:{epoch if s.epoch is None else s.epoch}" for s in self.random)

    def key(self, split: str, index: int, state: str) -> tuple:
        return (self.dataset, split, int(index), self.digest, state)

    def lookup(self, split: str, indices: np.ndarray, epoch: int, stop: threading.Event, deadline: float) -> FinalRows:
        """The final outputs the cache holds of ``indices`` (epoch ``epoch``), and the misses, claimed: a
        sample another request is computing now is waited for (until ``deadline``, monotonic, or
        ``stop``) before anything is claimed, as :meth:`PrefixCache.lookup` does."""
        rows = FinalRows(self.cache, self.state(epoch))
        keys = [self.key(split, index, rows.state) for index in indices.tolist()]
        rows.hits, rows.misses, rows.claimed = self.cache.take(keys, stop, deadline)
        self.cache.add_counts(self.dataset, len(rows.hits), len(rows.misses), final=True)
        return rows

    def store(self, rows: FinalRows, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray, epoch: int) -> None:
        """Keep the outputs ``x``, ``y`` of ``indices`` (copies), unless a control command changed a random
        stage's seed or epoch since :meth:`lookup` (they may be of either state: kept under neither)."""
        if self.state(epoch) != rows.state:
            return
        for row, index in enumerate(indices.tolist()):
            self.cache.put(self.key(split, index, rows.state), Entry(np.array(x[row]), np.array(y[row])))
