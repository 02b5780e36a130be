"""The decode cache's store, one per provider and shared by its pipelines (:class:`DecodeCache`): a RAM
tier of at most ``ram_bytes``, least recently used first out, over the optional disk tier
(:mod:`.disk_tier`); one byte budget for decoded samples and final outputs, final ones evicted first
(:func:`~.entries.make_room`); the claims by which requests that miss the same sample at once compute it
once (:meth:`DecodeCache.take`); and the counters ``busctl datasets`` and the metrics show."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import NotRequired, TypedDict

import numpy as np

from libbus.errors import ConfigError

from .disk_tier import DiskTier, DiskTierStats
from .entries import Entry, is_final, make_room

__all__ = [
    "DecodeCache",
    "DecodeCacheDataset",
    "DecodeCacheFinal",
    "DecodeCacheRow",
    "DecodeCacheStats",
    "decode_cache_stats",
]


class DecodeCacheDataset(TypedDict):
    """One dataset's share of the decode cache (``hits``, ``misses``: decoded samples; ``final_*``: final outputs)."""

    hits: int
    misses: int
    hit_rate: float
    entries: int
    bytes: int
    final_hits: int
    final_misses: int
    final_hit_rate: float


class DecodeCacheFinal(TypedDict):
    """The final outputs' share of the decode cache's RAM tier."""

    bytes: int
    entries: int
    hits: int
    misses: int
    hit_rate: float
    evictions: int


class DecodeCacheStats(TypedDict):
    """The decode cache's sizes, limits and counters (:meth:`DecodeCache.stats`; a provider's ``decode_cache``)."""

    limit_bytes: int
    bytes: int
    entries: int
    hits: int
    misses: int
    hit_rate: float
    evictions: int
    final: DecodeCacheFinal
    datasets: dict[str, DecodeCacheDataset]
    #: The disk tier, when it has one.
    disk: NotRequired[DiskTierStats]


class DecodeCacheRow(TypedDict, total=False):
    """What the decode cache adds to a provider's stats: ``decode_cache``, when its pipelines share one."""

    decode_cache: DecodeCacheStats


class DecodeCache:
    """The provider's cache of decoded samples (and of pipelines' final outputs, :class:`FinalCache`): a
    RAM tier of ``ram_bytes`` and, with ``disk_bytes`` and ``disk_dir``, a disk tier (see the package's
    docstring). Thread-safe: the pipelines' reading threads look up and store at once.

    Raises :class:`ConfigError` for a negative limit, or a disk directory that is a symlink.
    """

    def __init__(self, ram_bytes: int, disk_bytes: int = 0, disk_dir: str = ""):
        if ram_bytes < 0 or disk_bytes < 0:
            raise ConfigError(f"decode cache limits must not be negative, got {ram_bytes} and {disk_bytes}")
        if disk_bytes and not disk_dir:
            raise ConfigError("a decode cache disk tier needs a directory")
        self.limit = ram_bytes
        #: Decoded samples and final outputs, each least recent first; one byte budget for both.
        self._ram: OrderedDict[tuple, tuple[Entry, int]] = OrderedDict()
        self._final: OrderedDict[tuple, tuple[Entry, int]] = OrderedDict()
        self.bytes = self.final_bytes = 0
        self.hits = self.misses = self.evictions = 0
        self.final_hits = self.final_misses = self.final_evictions = 0
        #: Per dataset: ``[hits, misses, entries, bytes, final hits, final misses]`` (entries and bytes:
        #: both kinds, in the RAM tier).
        self._per: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self.disk = DiskTier(disk_dir, disk_bytes) if disk_bytes else None
        #: Keys being decoded now, by the chunk that claimed them: set when stored or given up.
        self._claims: dict[tuple, threading.Event] = {}

    @property
    def enabled(self) -> bool:
        return self.limit > 0 or self.disk is not None

    def get(self, key: tuple, *, count: bool = True) -> Entry | None:
        """The entry of ``key`` (RAM, then disk, promoting a disk hit), or None; ``count``: as a hit or a
        miss (:class:`PrefixCache` counts once per sample served instead)."""
        final = is_final(key)
        ram = self._final if final else self._ram
        with self._lock:
            found = ram.get(key)
            if found is not None:
                ram.move_to_end(key)
                if count:
                    self.count(key[0], 1, 0, final=final)
                return found[0]
        entry = self.disk.get(key) if self.disk is not None else None
        if count:
            with self._lock:
                self.count(key[0], int(entry is not None), int(entry is None), final=final)
        if entry is not None:
            self.put(key, entry, spill=False)
        return entry

    def count(self, dataset: str, hits: int, misses: int, *, final: bool = False) -> None:
        """Count lookups of ``dataset`` (the caller holds the lock, or calls :meth:`add_counts`);
        ``final``: of final outputs, else of decoded samples."""
        per = self._per.setdefault(dataset, [0] * 6)
        if final:
            self.final_hits += hits
            self.final_misses += misses
            per[4] += hits
            per[5] += misses
        else:
            self.hits += hits
            self.misses += misses
            per[0] += hits
            per[1] += misses

    def add_counts(self, dataset: str, hits: int, misses: int, *, final: bool = False) -> None:
        with self._lock:
            self.count(dataset, hits, misses, final=final)

    def claim(self, key: tuple) -> threading.Event | None:
        """None: the caller now decodes ``key`` and must :meth:`release` it. Else the event another
        decode of it sets when it ends (stored or given up)."""
        with self._lock:
            event = self._claims.get(key)
            if event is None:
                self._claims[key] = threading.Event()
            return event

    def take(
        self, keys: list[tuple], stop: threading.Event, deadline: float
    ) -> tuple[dict[int, Entry], np.ndarray, list[tuple]]:
        """The entries held of ``keys`` (by position), the positions missed, and the missed keys
        claimed for the caller to compute. A key another request is computing now is waited for (until
        ``deadline``, monotonic, or ``stop``), then taken, or computed here if that was given up. The
        claims come after any waiting: a caller that holds claims never waits, so two never wait on
        each other; a key claimed meanwhile by another is computed twice rather than waited for."""
        hits: dict[int, Entry] = {}
        todo: list[tuple[int, tuple]] = []
        waits: list[tuple[int, tuple, threading.Event]] = []
        for pos, key in enumerate(keys):
            entry = self.get(key, count=False)
            if entry is not None:
                hits[pos] = entry
            elif (event := self.claimed(key)) is not None:
                waits.append((pos, key, event))
            else:
                todo.append((pos, key))
        for pos, key, event in waits:
            while not event.wait(0.1) and not stop.is_set() and time.monotonic() < deadline:
                pass
            entry = self.get(key, count=False)
            if entry is None:
                todo.append((pos, key))  # given up, evicted already, or out of time: computed here
            else:
                hits[pos] = entry
        mine: set[tuple] = set()
        for _, key in todo:
            if key not in mine and self.claim(key) is None:
                mine.add(key)
        return hits, np.asarray(sorted(pos for pos, _ in todo), np.intp), list(mine)

    def claimed(self, key: tuple) -> threading.Event | None:
        """The event of a decode of ``key`` under way, or None."""
        with self._lock:
            return self._claims.get(key)

    def release(self, keys: list[tuple]) -> None:
        """End the claims on ``keys``: their waiters look again."""
        with self._lock:
            events = [self._claims.pop(key, None) for key in keys]
        for event in events:
            if event is not None:
                event.set()

    def put(self, key: tuple, entry: Entry, *, spill: bool = True) -> None:
        """Keep ``entry``; what the RAM tier evicts for it goes to the disk tier, and so does ``entry``
        itself if it does not fit in RAM (``spill``: False for an entry the disk tier gave back).
        Final entries are evicted before decoded ones, and a final entry never evicts a decoded one."""
        size = entry.nbytes
        final = is_final(key)
        ram = self._final if final else self._ram
        evicted: list[tuple[tuple, Entry]] = []
        with self._lock:
            old = ram.pop(key, None)
            if old is not None:
                self._account(key, -old[1])
            fits, victims = make_room(self._ram, self._final, self.bytes, self.final_bytes, self.limit, size, final)
            for k, (e, s), was_final in victims:
                self._account(k, -s)
                if was_final:
                    self.final_evictions += 1
                else:
                    self.evictions += 1
                evicted.append((k, e))
            if fits:
                ram[key] = (entry, size)
                self._account(key, size)
        if self.disk is not None:
            if not fits and spill:
                evicted.append((key, entry))
            for k, e in evicted:
                self.disk.put(k, e)

    def register(self, dataset: str) -> None:
        """List ``dataset`` in :meth:`stats` before its first read."""
        with self._lock:
            self._per.setdefault(dataset, [0] * 6)

    def _account(self, key: tuple, size: int) -> None:
        """An entry of ``size`` bytes in (positive) or out (negative) of the RAM tier."""
        per = self._per.setdefault(key[0], [0] * 6)
        per[2] += 1 if size > 0 else -1
        per[3] += size
        self.bytes += size
        if is_final(key):
            self.final_bytes += size

    def stats(self) -> DecodeCacheStats:
        """Sizes, limits and counters, overall and per dataset (``hit_rate``: hits / lookups).
        ``hits``, ``misses`` count decoded samples, ``final_hits``, ``final_misses`` final outputs;
        ``bytes``, ``entries`` hold both kinds (``final``: the final outputs' share)."""
        with self._lock:
            lookups = self.hits + self.misses
            final_lookups = self.final_hits + self.final_misses
            datasets: dict[str, DecodeCacheDataset] = {
                name: {
                    "hits": h,
                    "misses": m,
                    "hit_rate": _rate(h, h + m),
                    "entries": entries,
                    "bytes": size,
                    "final_hits": fh,
                    "final_misses": fm,
                    "final_hit_rate": _rate(fh, fh + fm),
                }
                for name, (h, m, entries, size, fh, fm) in sorted(self._per.items())
            }
            out: DecodeCacheStats = {
                "limit_bytes": self.limit,
                "bytes": self.bytes,
                "entries": len(self._ram) + len(self._final),
                "hits": self.hits,
                "misses": self.misses,
                "hit_rate": _rate(self.hits, lookups),
                "evictions": self.evictions,
                "final": {
                    "bytes": self.final_bytes,
                    "entries": len(self._final),
                    "hits": self.final_hits,
                    "misses": self.final_misses,
                    "hit_rate": _rate(self.final_hits, final_lookups),
                    "evictions": self.final_evictions,
                },
                "datasets": datasets,
            }
        if self.disk is not None:
            out["disk"] = self.disk.stats()
        return out

    def close(self) -> None:
        """Drop every entry; empty the disk tier's directory."""
        with self._lock:
            self._ram.clear()
            self._final.clear()
            self.bytes = self.final_bytes = 0
            for per in self._per.values():
                per[2] = per[3] = 0
        if self.disk is not None:
            self.disk.close()
            self.disk = None


def _rate(hits: int, lookups: int) -> float:
    return round(hits / lookups, 4) if lookups else 0.0


def decode_cache_stats(caches: list[DecodeCache]) -> DecodeCacheRow:
    """``{"decode_cache": stats}`` for the (one) cache the pipelines share, else ``{}``."""
    seen = {id(c): c for c in caches}
    if not seen:
        return {}
    return {"decode_cache": next(iter(seen.values())).stats()}
