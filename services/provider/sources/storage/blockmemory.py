"""Blocks of remote files kept in the provider's RAM: a full shuffle read from a store at block speed.

A full-shuffle batch of 256 samples from a store is 256 requests per file (its samples lie anywhere),
each paying the store's first-byte time; a block shuffle's is one or a few. With ``ram_cache=BYTES`` on
a remote dataset, its reads go by fixed-size blocks (``block``, default :data:`BLOCK_BYTES`) of each
file through a :class:`BlockMemory`: a block is fetched whole the first time any sample in it is
asked for, and every later read of it, by any batch or loader, is a copy from RAM. When the cache holds
the span the shuffle draws from (for a full shuffle, the dataset; sized by the operator), every block is
fetched once per epoch, or once for good, and the shuffle costs what a sequential read does.

**Read-ahead.** A loader knows the samples it will ask for next (its order is a function of seed,
epoch, cursor and skips) and may say so (:class:`~libbus.wire.messages.ReadAhead`): :meth:`BlockMemory.prefetch`
then fetches the blocks those samples lie in, in the order they will be needed, ``depth`` at a time (the
dataset's requests in flight, which the batches' own requests share), at most half the cache's worth, so
a plan never evicts the blocks it fetched before they are read. Each plan replaces its owner's last one (a loader's new
pass, a seek): blocks not yet started are dropped; an empty plan cancels.

Least recently used blocks go once the bytes held pass the limit. A block asked for while it is being
fetched is waited for, never fetched twice. A failed fetch fails the batches that wanted it and is
not kept: the next read asks again. Bytes are copied out under no lock (a block is immutable once in).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Executor, Future, wait
from functools import partial
from typing import Any, TypedDict

__all__ = ["BLOCK_BYTES", "BlockMemory", "RamCacheStats", "ReadStats", "by_block"]

#: The default block: large enough that one request carries many samples, small enough that a cache of
#: a few hundred MiB holds hundreds of them.
BLOCK_BYTES = 1 << 20

#: ``(file, offset, buffers)``: a run of a file to read into buffers (:class:`~.reader.RemoteClient`).
Run = tuple[Any, int, list[memoryview]]


def by_block(runs: list[Run], block: int) -> dict[tuple[Any, int], list[tuple[int, memoryview]]]:
    """The runs' buffers cut at block boundaries: (file, block number) → (offset in block, piece)."""
    out: dict[tuple[Any, int], list[tuple[int, memoryview]]] = {}
    for f, offset, buffers in runs:
        pos = offset
        for buf in buffers:
            view = buf.cast("B") if buf.format != "B" else buf
            while len(view):
                b = pos // block
                n = min(len(view), (b + 1) * block - pos)
                out.setdefault((f, b), []).append((pos - b * block, view[:n]))
                view, pos = view[n:], pos + n
    return out


class RamCacheStats(TypedDict, total=False):
    """A remote dataset's RAM cache (:meth:`BlockMemory.stats`): every key when it has one, none without."""

    #: Bytes of blocks held.
    ram_cache_bytes: int
    #: Reads served from a block held.
    ram_cache_hits: int
    #: Blocks fetched.
    ram_cache_fetches: int
    #: Reads that waited for a block being fetched rather than fetch it again.
    ram_cache_joined: int
    #: Blocks fetched ahead of the reads, for a loader's read-ahead plan.
    ram_cache_prefetched: int
    #: Blocks planned ahead and not fetched yet.
    ram_cache_ahead: int
    #: Blocks evicted.
    ram_cache_evictions: int


class ReadStats(RamCacheStats, total=False):
    """How a remote dataset's reads go now (a client's ``read_stats``, a ``remote_reads`` row of its
    provider's ``Stats``): requests in flight, their limit now, and its RAM cache's counters. Empty for a
    place read locally."""

    inflight: int
    inflight_limit: int


class BlockMemory:
    """At most ``limit`` bytes of ``block``-byte blocks, least recently used out (see the module doc)."""

    def __init__(self, limit: int, block: int = BLOCK_BYTES):
        self.limit, self.block = limit, block
        self._blocks: OrderedDict[Hashable, bytes] = OrderedDict()
        self._fetching: dict[Hashable, Future] = {}
        self._held = 0
        self._lock = threading.Lock()
        #: Blocks read from RAM, fetched, joined (asked for while being fetched), evicted, fetched ahead.
        self.hits = self.fetches = self.joined = self.evictions = self.prefetched = 0
        #: owner → its read-ahead plan: the blocks still to start, and how to fetch them.
        self._plans: dict[Hashable, tuple[deque, Callable, Callable, Callable, Executor, int]] = {}
        self._ahead = 0  # read-ahead fetches running now

    @property
    def held(self) -> int:
        """Bytes of blocks held now."""
        return self._held

    def read(
        self,
        runs: list[Run],
        key: Callable[[Any], Hashable],
        size: Callable[[Any], int],
        fetch: Callable[[Any, int, int], bytes | bytearray | memoryview],
        pool: Executor,
    ) -> None:
        """Fill every run's buffers through the cache: ``key(file)`` names a file's blocks (its version
        included), ``size(file)`` is its length, and ``fetch(file, start, length)`` reads a block, run on
        ``pool`` for the blocks missing. Waits for every fetch before returning or raising, so nothing
        writes into a buffer after the batch has failed."""
        wanted = by_block(runs, self.block)
        found: dict[tuple[Any, int], bytes] = {}
        waiting: dict[tuple[Any, int], Future] = {}
        mine: list[tuple[Hashable, Future]] = []
        with self._lock:
            for f, b in wanted:
                name = (key(f), b)
                data = self._blocks.get(name)
                if data is not None:
                    self._blocks.move_to_end(name)
                    self.hits += 1
                    found[(f, b)] = data
                    continue
                fut = self._fetching.get(name)
                if fut is not None:
                    self.joined += 1
                else:
                    fut = self._fetching[name] = Future()
                    mine.append((name, fut))
                    self.fetches += 1
                    start = b * self.block
                    pool.submit(self._fetch, name, fut, fetch, f, start, min(self.block, size(f) - start))
                waiting[(f, b)] = fut
        wait(waiting.values())
        for where, fut in waiting.items():
            if (err := fut.exception()) is not None:
                raise err
            found[where] = fut.result()
        for where, pieces in wanted.items():
            data = found[where]
            for at, view in pieces:
                view[:] = data[at : at + len(view)]

    def prefetch(
        self,
        owner: Hashable,
        blocks: list[tuple[Any, int]],
        key: Callable[[Any], Hashable],
        size: Callable[[Any], int],
        fetch: Callable[[Any, int, int], bytes | bytearray | memoryview],
        pool: Executor,
        depth: int,
    ) -> int:
        """Replace ``owner``'s read-ahead plan by ``blocks`` (``(file, block number)``, in the order they
        will be needed; see the module doc), fetched ``depth`` at a time across every owner. Returns how
        many blocks the plan holds (what is held or being fetched already is left out)."""
        budget = max(1, self.limit // self.block // 2)
        with self._lock:
            plan: deque = deque()
            for f, b in blocks:
                if len(plan) >= budget:
                    break
                name = (key(f), b)
                if name not in self._blocks and name not in self._fetching:
                    plan.append((f, b))
            if plan:
                self._plans[owner] = (plan, key, size, fetch, pool, max(1, depth))
            else:
                self._plans.pop(owner, None)
            starts = self._next_ahead()
        for task in starts:
            task()
        return len(plan)

    def cancel(self, owner: Hashable) -> None:
        """Drop ``owner``'s plan: the blocks not yet started are not fetched."""
        with self._lock:
            self._plans.pop(owner, None)

    def _next_ahead(self) -> list[Callable[[], object]]:
        """(Under the lock.) Read-ahead fetches to start now: the plans' next blocks, taken in turn."""
        starts: list[Callable[[], object]] = []
        while self._plans:
            progressed = False
            for owner in list(self._plans):
                plan, key, size, fetch, pool, depth = self._plans[owner]
                if self._ahead >= depth:
                    return starts
                while plan:
                    f, b = plan.popleft()
                    name = (key(f), b)
                    if name in self._blocks or name in self._fetching:
                        continue
                    fut: Future = Future()
                    self._fetching[name] = fut
                    self._ahead += 1
                    self.prefetched += 1
                    start = b * self.block
                    length = min(self.block, size(f) - start)
                    starts.append(partial(pool.submit, self._fetch_ahead, name, fut, fetch, f, start, length))
                    progressed = True
                    break
                if not plan:
                    self._plans.pop(owner, None)
            if not progressed:
                break
        return starts

    def _fetch_ahead(self, name: Hashable, fut: Future, fetch, f, start: int, length: int) -> None:
        try:
            self._fetch(name, fut, fetch, f, start, length)
        finally:
            with self._lock:
                self._ahead -= 1
                starts = self._next_ahead()
            for task in starts:
                task()

    def _fetch(self, name: Hashable, fut: Future, fetch, f, start: int, length: int) -> None:
        try:
            data = bytes(fetch(f, start, length))
        except BaseException as err:  # noqa: BLE001 - every waiter hears it; the block is not kept
            with self._lock:
                self._fetching.pop(name, None)
            fut.set_exception(err)
            return
        with self._lock:
            self._fetching.pop(name, None)
            if len(data) <= self.limit:
                self._blocks[name] = data
                self._held += len(data)
                while self._held > self.limit:
                    _, old = self._blocks.popitem(last=False)
                    self._held -= len(old)
                    self.evictions += 1
        fut.set_result(data)

    def stats(self) -> RamCacheStats:
        with self._lock:
            return {
                "ram_cache_bytes": self._held,
                "ram_cache_hits": self.hits,
                "ram_cache_fetches": self.fetches,
                "ram_cache_joined": self.joined,
                "ram_cache_prefetched": self.prefetched,
                "ram_cache_ahead": self._ahead + sum(len(plan[0]) for plan in self._plans.values()),
                "ram_cache_evictions": self.evictions,
            }
