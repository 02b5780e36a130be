"""The provider's decoded-sample cache: samples as they leave a pipeline's deterministic prefix.

A pipeline's stages up to (not including) its first random stage give the same sample for the same
(split, index) whatever the job, its seed or its epoch: the source read, ``decode``, ``resize``,
``normalize`` … That output is what :class:`DecodeCache` keeps, so that every job and every trial of a
study reading the dataset shares one decode, while the random stages after it still run per request
from (seed, epoch, index): each job's bytes are those of an uncached run.

One :class:`DecodeCache` per provider, shared by its pipelines (docs/datasets.md §7.7):

- a RAM tier of at most ``ram_bytes``, least recently used first out;
- optionally a disk tier of at most ``disk_bytes`` under its own directory, which takes what the RAM
  tier evicts and gives it back on a hit (promoted to RAM). Each file carries a magic, its key and a
  BLAKE2b digest of its key and contents: a truncated, corrupt or foreign file is a miss (the sample
  is decoded again), counted and removed, never served. Files are opened relative to the directory
  with ``O_NOFOLLOW`` and the directory itself must not be a symlink, so the tier never reads or writes
  outside it. The directory is emptied when the cache opens and when it closes (the source files may
  have changed while the provider was down).

A key is ``(dataset, split, index, digest of the prefix's stage types and parameters)``: two pipelines,
datasets or splits never share an entry unless they would produce the same sample. :class:`PrefixCache`
is that binding for one pipeline.

Requests that miss the same sample at once decode it once: the first claims it, the others wait for
its store (at most until their batch's deadline, or the pipeline stops) and take it from the cache; a
claim whose chunk fails or is dropped is released, and a waiter then decodes the sample itself.

**Final outputs.** A pipeline's random stages draw from ``(seed, epoch, split, stage, index)`` alone
(:class:`~.stages.RandomStage`: the stage's seed from the pipeline file or a control command, the
request's epoch unless one is pinned), never from the job that asks. So the whole pipeline's output
for a sample is a function of the key ``(dataset, split, index, digest of every stage, the random
stages' seeds and epochs)``, and :class:`FinalCache` keeps it in the same cache: every job reading an
epoch of the dataset after the first gets its samples without running any stage, byte for byte. Final
entries are second in line for the byte budget (both tiers): a decoded entry evicts final entries
before any decoded one, and a final entry evicts only final entries (it is not kept when the decoded
ones leave no room), since a final entry serves one epoch while a decoded one serves every epoch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from libbus.errors import ConfigError

__all__ = ["DecodeCache", "Entry", "FinalCache", "PrefixCache", "decode_cache_stats", "file_name", "prefix_digest"]

log = logging.getLogger(__name__)

#: First bytes of every disk-tier file (format version 1).
MAGIC = b"BBDECODE1\n"
_DIGEST = 32
_SUFFIX = ".dc"
#: Sample kinds held as one Python object per sample (a Pillow image, a token list), not array rows.
OBJECT_KINDS = ("encoded", "decoded", "token_lists")
#: Stage parameters that change how a stage runs, not what it produces: left out of the digest.
_NOT_OUTPUT = frozenset({"workers"})
#: A final-output key is ``(dataset, split, index, digest, random state)``; a decoded one has no state.
_FINAL_KEY_LEN = 5


def is_final(key: tuple) -> bool:
    """Whether ``key`` names a pipeline's final output (:class:`FinalCache`), not a decoded sample."""
    return len(key) == _FINAL_KEY_LEN


def _room(decoded: OrderedDict, final: OrderedDict, used: int, final_used: int, limit: int, size: int, is_fin: bool):
    """Which entries to evict (least recent first) so that ``size`` more bytes fit under ``limit``, the
    final entries before any decoded one, and a final entry evicting only final ones: ``(fits, victims)``,
    each victim ``(key, the dict's value, whether final)``, popped from its dict; nothing popped when it
    does not fit. The dicts' values are sizes, or ``(entry, size)``."""
    if size > limit or (is_fin and size > limit - used + final_used):
        return False, []
    victims = []
    for tier in (final, decoded):
        while used + size > limit and tier:
            key, value = tier.popitem(last=False)
            victims.append((key, value, tier is final))
            used -= value if isinstance(value, int) else value[1]
    return True, victims


@dataclass(frozen=True)
class Entry:
    """One cached sample: its value (a numpy row, or a Pillow image) and its label row."""

    x: Any
    y: np.ndarray

    @property
    def nbytes(self) -> int:
        return _value_bytes(self.x) + int(self.y.nbytes)


def _is_image(value: Any) -> bool:
    return hasattr(value, "getbands") and hasattr(value, "tobytes") and hasattr(value, "size")


def _value_bytes(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if _is_image(value):
        w, h = value.size
        # Pillow keeps RGB, RGBA, CMYK … as 4 bytes a pixel, L/P/1 as one
        return w * h * (1 if len(value.getbands()) == 1 else 4)
    return 1024  # another object (a token list …): counted at a nominal size; RAM tier only


def prefix_digest(stages: list) -> str:
    """A hex digest of what ``stages`` (a pipeline's deterministic prefix) produce: their types and
    parameters in order, the source's URI among them."""
    parts = [(s.type, s.name, {k: v for k, v in sorted(s.config.items()) if k not in _NOT_OUTPUT}) for s in stages]
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


def _key_text(key: tuple) -> str:
    return "\x1f".join(str(part) for part in key)


def file_name(key: tuple) -> str:
    """The disk-tier file name of ``key`` (a digest: keys hold dataset names and paths)."""
    return hashlib.blake2b(_key_text(key).encode(), digest_size=20).hexdigest() + _SUFFIX


# -- disk-tier encoding --------------------------------------------------------------------------


def _encode(key: tuple, entry: Entry) -> bytes | None:
    """The file bytes for ``entry``, or None for a value the disk tier does not hold."""
    x = entry.x
    if isinstance(x, np.ndarray) and x.dtype.kind in "biuf":
        xhead: dict = {"kind": "array", "dtype": x.dtype.str, "shape": list(x.shape)}
        xbytes = x.tobytes()
    elif _is_image(x):
        xhead = {"kind": "image", "mode": x.mode, "size": list(x.size)}
        xbytes = x.tobytes()
    else:
        return None
    y = np.asarray(entry.y)  # not ascontiguousarray: it makes a 0-d label 1-d
    head = orjson.dumps(
        {"key": _key_text(key), "x": xhead, "y": {"dtype": y.dtype.str, "shape": list(y.shape)}, "nx": len(xbytes)}
    )
    body = len(head).to_bytes(4, "little") + head + xbytes + y.tobytes()
    digest = hashlib.blake2b(body, digest_size=_DIGEST).digest()
    return MAGIC + digest + len(body).to_bytes(8, "little") + body


class _Corrupt(Exception):
    pass


def _decode(key: tuple, data: bytes) -> Entry:
    """The entry in ``data``; raises :class:`_Corrupt` for anything but an intact file of ``key``."""
    top = len(MAGIC) + _DIGEST + 8
    if len(data) < top or not data.startswith(MAGIC):
        raise _Corrupt("bad magic or truncated header")
    digest = data[len(MAGIC) : len(MAGIC) + _DIGEST]
    size = int.from_bytes(data[top - 8 : top], "little")
    body = data[top:]
    if len(body) != size:
        raise _Corrupt(f"{len(body)} body bytes, header says {size}")
    if hashlib.blake2b(body, digest_size=_DIGEST).digest() != digest:
        raise _Corrupt("digest mismatch")
    try:
        hlen = int.from_bytes(body[:4], "little")
        head = orjson.loads(body[4 : 4 + hlen])
        if head["key"] != _key_text(key):
            raise _Corrupt("another sample's file")
        rest = body[4 + hlen :]
        xbytes, ybytes = rest[: head["nx"]], rest[head["nx"] :]
        xh, yh = head["x"], head["y"]
        if xh["kind"] == "array":
            x: Any = np.frombuffer(xbytes, np.dtype(xh["dtype"])).reshape(tuple(xh["shape"])).copy()
        else:
            from PIL import Image

            x = Image.frombytes(xh["mode"], tuple(xh["size"]), xbytes)
        y = np.frombuffer(ybytes, np.dtype(yh["dtype"])).reshape(tuple(yh["shape"])).copy()
    except (KeyError, TypeError, ValueError, orjson.JSONDecodeError) as err:
        raise _Corrupt(f"unreadable contents: {err}") from err
    return Entry(x, y)


class _DiskTier:
    """Files of entries in one directory, at most ``limit`` bytes, least recently used removed first."""

    def __init__(self, directory: str, limit: int):
        self.path = Path(directory)
        self.limit = limit
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.lstat(self.path)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"decode cache directory {self.path} must be a directory, not a symlink")
        self.dir_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        # file name -> bytes, least recent first: decoded samples, and final outputs (evicted first)
        self.files: OrderedDict[str, int] = OrderedDict()
        self.finals: OrderedDict[str, int] = OrderedDict()
        self.bytes = self.final_bytes = 0
        self.hits = self.writes = self.corrupt = self.evictions = 0
        self.lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        """Remove every cache file (and leftover temporary) in the directory; leave anything else."""
        with self.lock:
            for name in os.listdir(self.dir_fd):
                if name.endswith((_SUFFIX, ".tmp")):
                    try:
                        if stat.S_ISREG(os.lstat(name, dir_fd=self.dir_fd).st_mode):
                            os.unlink(name, dir_fd=self.dir_fd)
                    except FileNotFoundError:
                        pass
            self.files.clear()
            self.finals.clear()
            self.bytes = self.final_bytes = 0

    def get(self, key: tuple) -> Entry | None:
        name = file_name(key)
        files = self.finals if is_final(key) else self.files
        with self.lock:
            if name not in files:
                return None
            files.move_to_end(name)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=self.dir_fd)
        except OSError:  # gone, or a symlink put in its place (ELOOP)
            self._forget(name, files, unlink=False)
            return None
        try:
            with os.fdopen(fd, "rb") as fh:
                if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                    raise _Corrupt("not a regular file")
                data = fh.read()
            entry = _decode(key, data)
        except (OSError, _Corrupt) as err:
            log.warning("decode cache: %s/%s is unusable (%s); decoding that sample again", self.path, name, err)
            with self.lock:
                self.corrupt += 1
            self._forget(name, files, unlink=True)
            return None
        with self.lock:
            self.hits += 1
        return entry

    def put(self, key: tuple, entry: Entry) -> None:
        name = file_name(key)
        final = is_final(key)
        files = self.finals if final else self.files
        with self.lock:  # a key's bytes are a function of the key: a file of it already here is kept
            if name in files:
                files.move_to_end(name)
                return
        data = _encode(key, entry)
        if data is None or len(data) > self.limit:
            return
        with self.lock:  # room first: a final file that would evict a decoded one is not written
            fits, evicted = _room(self.files, self.finals, self.bytes, self.final_bytes, self.limit, len(data), final)
            victims = self._evicted(evicted)
        self._unlink(victims)
        if not fits:
            return
        tmp = f"{name}.{threading.get_ident()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=self.dir_fd)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        except OSError as err:
            log.warning("decode cache: cannot write %s/%s: %s", self.path, name, err)
            try:
                os.unlink(tmp, dir_fd=self.dir_fd)
            except OSError:
                pass
            return
        with self.lock:
            # another thread may have made room meanwhile: evict again until this file fits
            self._forget_locked(name, self.finals if final else self.files)
            fits, evicted = _room(self.files, self.finals, self.bytes, self.final_bytes, self.limit, len(data), final)
            victims = self._evicted(evicted)
            if fits:
                (self.finals if final else self.files)[name] = len(data)
                self.bytes += len(data)
                self.final_bytes += len(data) if final else 0
                self.writes += 1
            else:
                victims.append(name)
        self._unlink(victims)

    def _evicted(self, evicted: list) -> list[str]:
        """Account for ``evicted`` (``_room``'s victims, already out of their dicts); their names."""
        for _, size, final in evicted:
            self.bytes -= size
            self.final_bytes -= size if final else 0
            self.evictions += 1
        return [old for old, _, _ in evicted]

    def _unlink(self, names: list[str]) -> None:
        for old in names:
            try:
                os.unlink(old, dir_fd=self.dir_fd)
            except OSError:
                pass

    def _forget_locked(self, name: str, files: OrderedDict) -> None:
        size = files.pop(name, 0)
        self.bytes -= size
        if files is self.finals:
            self.final_bytes -= size

    def _forget(self, name: str, files: OrderedDict, *, unlink: bool) -> None:
        with self.lock:
            self._forget_locked(name, files)
        if unlink:
            self._unlink([name])

    def stats(self) -> dict:
        with self.lock:
            return {
                "dir": str(self.path),
                "limit_bytes": self.limit,
                "bytes": self.bytes,
                "entries": len(self.files) + len(self.finals),
                "final_entries": len(self.finals),
                "final_bytes": self.final_bytes,
                "hits": self.hits,
                "writes": self.writes,
                "corrupt": self.corrupt,
                "evictions": self.evictions,
            }

    def close(self) -> None:
        self.clear()
        os.close(self.dir_fd)


class DecodeCache:
    """The provider's cache of decoded samples (and of pipelines' final outputs, :class:`FinalCache`): a
    RAM tier of ``ram_bytes`` and, with ``disk_bytes`` and ``disk_dir``, a disk tier (see the module's
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
        self.disk = _DiskTier(disk_dir, disk_bytes) if disk_bytes else None
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
            fits, victims = _room(self._ram, self._final, self.bytes, self.final_bytes, self.limit, size, final)
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

    def stats(self) -> dict:
        """Sizes, limits and counters, overall and per dataset (``hit_rate``: hits / lookups).
        ``hits``, ``misses`` count decoded samples, ``final_hits``, ``final_misses`` final outputs;
        ``bytes``, ``entries`` hold both kinds (``final``: the final outputs' share)."""
        with self._lock:
            lookups = self.hits + self.misses
            final_lookups = self.final_hits + self.final_misses
            datasets: dict[str, dict] = {
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
            out: dict[str, Any] = {
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


def decode_cache_stats(caches: list[DecodeCache]) -> dict:
    """``{"decode_cache": stats}`` for the (one) cache the pipelines share, else ``{}``."""
    seen = {id(c): c for c in caches}
    if not seen:
        return {}
    return {"decode_cache": next(iter(seen.values())).stats()}
