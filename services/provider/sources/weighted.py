"""``weighted://FILE.toml``: one virtual dataset mixing several sources in fixed proportions.

``FILE.toml`` lists the sources, each a URI or the name of a dataset the same provider serves
(given before the mix on its command line), with an optional weight::

    [[sources]]
    uri = "mock://mnist?n=6000"
    weight = 3
    [[sources]]
    dataset = "digits"        # served by this provider, listed before the mix
    weight = 1

Every split mixes the sources' same split. Without weights, each source weighs its length in that
split: an epoch of the mix is then every sample of every source exactly once. With weights, an
epoch is still as long as all the sources together; a source whose share asks for more samples
than it has starts over (its sample ``k`` is ``k mod len``), one asking for fewer leaves its tail.

Which source position ``i`` of the mix takes is fixed by an error-balancing schedule (Balinski and
Young's quota method), not by random draws: after any ``N`` positions, each source has had within
one sample of ``N * w / sum(w)``. The schedule repeats every ``sum(w) / gcd(w)`` positions; one
period is computed at start-up (one byte per position, a few seconds per ten million) and any
position is then located in O(1).
A batch's samples from one source are read with one call to that source.

Sources with named fields mix too, when they agree on them (below).

A mix serves its sources' named fields when they are *union-compatible*: the same names in the same
order, and for each the same dtype and shape, ``None`` (variable) dimensions in the same places. A
source that disagrees, or an x/y dataset beside named-field ones, is refused when the mix is opened,
naming both sources and the field. The mix declares each variable field's largest ``max_bytes`` (a
source that declares none makes the mix's undeclared: its batches then travel over the socket).
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Callable, Mapping
from fractions import Fraction
from pathlib import Path
from urllib.parse import unquote

import numpy as np

from libbus.errors import DatasetError

from .base import SPLITS, Field, FieldBatch, OpenRequest, Source, SourceInfo

__all__ = ["MAX_PERIOD", "Mix", "Schedule", "integer_weights", "open_weighted"]

#: Longest schedule period computed at start-up (positions; one byte each);
#: beyond it, give explicit weights with a smaller sum.
MAX_PERIOD = 100_000_000
#: Positions per checkpoint of the running counts: bounds the work to locate one position.
BLOCK = 64
#: Cells (sources x positions) of the matrices one step of the schedule's construction uses.
CHUNK_CELLS = 1 << 20
#: Positions located at once (a batch may name up to a million).
LOCATE_CHUNK = 1 << 14
ENTRY_KEYS = {"uri", "dataset", "weight"}
#: DatasetInfo keys a mix passes on when every source agrees on them (tokens: seq_len, ...).
SHARED_INFO = ("seq_len", "vocab_size", "token_bytes")


def integer_weights(weights: list) -> list[int]:
    """Positive weights (ints or floats, read exactly as written) scaled to coprime integers."""
    fracs = [Fraction(repr(w)) if isinstance(w, float) else Fraction(w) for w in weights]
    scale = math.lcm(*(f.denominator for f in fracs))
    ints = [int(f * scale) for f in fracs]
    g = math.gcd(*ints)
    return [i // g for i in ints]


def _exact_step(weights: list[int], counts: list[int], t: int) -> int:
    """The source the quota method gives position ``t`` (1-based), given the counts before it."""
    total, best = sum(weights), -1
    for j, (c, w) in enumerate(zip(counts, weights)):
        if c * total < t * w and (best < 0 or (c + 1) * weights[best] < (counts[best] + 1) * w):
            best = j
    return best


class Schedule:
    """Which source each position of a mix takes, and which of that source's samples.

    Built by the quota method: position ``t`` goes to the source that, among those still under
    their upper quota (``count < t * w / W``), has the earliest deadline (smallest
    ``(count + 1) / w``). It keeps every prefix's counts between ``floor`` and ``ceil`` of
    ``N * w / W``, and every count grows by one at a time, so locating a position needs only the
    counts before it.
    """

    def __init__(self, weights: list[int]):
        if not weights or any(w < 1 for w in weights):
            raise ValueError(f"weights must be positive integers, got {weights}")
        self.weights = weights
        self.period = sum(weights)
        if self.period > MAX_PERIOD:
            raise DatasetError(
                f"weights {weights} repeat only every {self.period} samples (more than "
                f"{MAX_PERIOD}); give simpler explicit weights such as 3 and 1"
            )
        self.ids, self.checkpoints = self._build()

    def _build(self) -> tuple[np.ndarray, np.ndarray]:
        """One period of source ids, and the counts before every :data:`BLOCK`-th position.

        Chunks of positions are proposed in deadline order at once (a merge of each source's next
        deadlines, in floating point), then checked exactly in integers: a proposed pick stands if
        it is under its upper quota and no source under its quota has an earlier deadline (or the
        same one and a lower number). At the first position that fails, one exact step is taken.
        """
        w = np.asarray(self.weights, np.int64)
        total, s = self.period, len(self.weights)
        ids = np.empty(total, np.uint8 if s <= 256 else np.uint16)
        counts = np.zeros(s, np.int64)
        numbers = np.arange(s)
        done, chunk = 0, 256
        while done < total:
            m = min(chunk, total - done, max(64, CHUNK_CELLS // s))
            ahead = np.arange(m)
            keys = (counts[:, None] + 1 + ahead) / w[:, None]  # the next m deadlines of each source
            owner = np.repeat(numbers, m)
            picks = owner[np.lexsort((owner, keys.ravel()))[:m]]
            chosen = picks[None, :] == numbers[:, None]
            before = np.cumsum(chosen, axis=1) - chosen + counts[:, None]  # counts before each step
            step = done + 1 + ahead
            under = before * total < step * w[:, None]  # under the upper quota at that step
            mine = before[picks, ahead]
            earlier = (before + 1) * w[picks] - (mine + 1) * w[:, None]  # < 0: an earlier deadline
            beaten = under & ((earlier < 0) | ((earlier == 0) & (numbers[:, None] < picks)))
            ok = under[picks, ahead] & ~beaten.any(axis=0)
            good = m if ok.all() else int(np.argmin(ok))
            ids[done : done + good] = picks[:good]
            counts += chosen[:, :good].sum(axis=1)
            done += good
            if good < m:
                best = _exact_step(self.weights, counts.tolist(), done + 1)
                ids[done] = best
                counts[best] += 1
                done += 1
            chunk = chunk * 2 if good == m else max(64, 2 * good)
        return ids, self._checkpoints(ids)

    def _checkpoints(self, ids: np.ndarray) -> np.ndarray:
        """Counts of each source before positions 0, BLOCK, 2 BLOCK, ..."""
        starts = np.arange(0, self.period, BLOCK)
        out = np.zeros((len(starts), len(self.weights)), np.int64)
        for j in range(len(self.weights)):
            out[1:, j] = np.cumsum(np.add.reduceat(ids == j, starts, dtype=np.int64)[:-1])
        return out

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, k)`` per position: the mix's sample ``positions[r]`` is the ``k[r]``-th sample
        the schedule gives to ``source[r]``."""
        positions = np.asarray(positions, np.int64).reshape(-1)
        if len(positions) > LOCATE_CHUNK:  # bounds the (positions x BLOCK) temporaries
            parts = [self.locate(positions[a : a + LOCATE_CHUNK]) for a in range(0, len(positions), LOCATE_CHUNK)]
            return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        laps, r = np.divmod(positions, self.period)
        src = self.ids[r].astype(np.int64)
        block = r // BLOCK
        starts = block * BLOCK
        window = np.minimum(starts[:, None] + np.arange(BLOCK), self.period - 1)
        before = (self.ids[window] == src[:, None]) & (np.arange(BLOCK) < (r - starts)[:, None])
        k = self.checkpoints[block, src] + before.sum(axis=1) + laps * np.asarray(self.weights)[src]
        return src, k


class Mix(Source):
    """Several sources with the same sample shape and dtype (or the same named fields), mixed by a
    :class:`Schedule` per split."""

    def __init__(
        self, uri: str, names: list[str], sources: list[Source], weights: list | None, labels: list[str] | None = None
    ):
        self.uri, self.names, self.sources = uri, names, sources
        self.remote = any(s.remote for s in sources)  # a batch waits on its slowest member's reads
        #: How a location names each member: the dataset it serves under, else ``source N`` (its place
        #: in the TOML, from 1): never the TOML's path or a member URI's (a provider's own paths).
        self.labels = labels or [f"source {i + 1}" for i in range(len(sources))]
        first = sources[0]
        #: The named fields every source serves (:func:`mix_fields`); None for x/y sources.
        self._fields = mix_fields(uri, names, sources)
        # encoded text (lines, a Parquet column) feeds tokenize, which drops labels: those may differ
        unlabelled = first.kind == "encoded" and any(s.label_shape == (0,) for s in sources)
        for name, src in zip(names[1:], sources[1:]):
            for attr in ("kind", "sample_shape", "dtype", "label_shape", "label_dtype"):
                if self._fields is not None or (unlabelled and attr.startswith("label")):
                    break  # named fields: agreeing on them is what counts
                if getattr(src, attr) != getattr(first, attr):
                    raise DatasetError(
                        f"{uri}: {name} has {attr} {getattr(src, attr)} but {names[0]} has "
                        f"{getattr(first, attr)}; every source of a mix must agree"
                    )
        self.sample_shape, self.dtype = first.sample_shape, first.dtype
        self.label_shape, self.label_dtype, self.kind = first.label_shape, first.label_dtype, first.kind
        if unlabelled:
            self.label_shape = (0,)
        self.num_classes = max(s.num_classes for s in sources)
        same_names = all(s.class_names == first.class_names for s in sources)
        self.class_names = (
            list(first.class_names)
            if same_names
            else ([str(i) for i in range(self.num_classes)] if first.class_names else [])
        )
        self.weights = weights
        self._splits = {split: self._plan(split) for split in SPLITS}

    def _plan(self, split: str) -> tuple[int, list[int], Schedule | None]:
        """(length, the sources taking part, their schedule) for ``split``: sources with no samples
        in it sit it out."""
        sizes = [s.num_samples(split) for s in self.sources]
        members = [i for i, n in enumerate(sizes) if n > 0]
        if not members:
            return 0, [], None
        raw = [self.weights[i] if self.weights else sizes[i] for i in members]
        return sum(sizes[i] for i in members), members, Schedule(integer_weights(raw))

    def num_samples(self, split: str) -> int:
        return self._splits[split][0]

    def info(self) -> SourceInfo:
        info = super().info()
        infos = [s.info() for s in self.sources]
        for key in SHARED_INFO:
            values = {i.get(key) for i in infos}
            if len(values) == 1 and None not in values:
                info[key] = values.pop()  # type: ignore[literal-required]  # one of SHARED_INFO's int keys
        _, members, schedule = self._splits["train"]
        shares = {i: w / schedule.period for i, w in zip(members, schedule.weights)} if schedule else {}
        info["format"] = "weighted"
        # each member by its label (the dataset it serves under, else ``source N``): its name in
        # errors holds the mix file's path, which only the operator's ``uri`` may show
        info["sources"] = [
            {"name": label, "uri": src.uri, "train_share": shares.get(i, 0.0)}
            for i, (label, src) in enumerate(zip(self.labels, self.sources))
        ]
        return info

    @property
    def fields(self) -> list[Field]:
        return list(self._fields) if self._fields is not None else super().fields

    def _located(self, split: str, indices: np.ndarray) -> list[tuple[Source, np.ndarray, np.ndarray]]:
        """``(source, its local indices, the batch rows they fill)`` per source the batch touches."""
        return [(self.sources[m], local, rows) for m, local, rows in self._by_member(split, indices)]

    def _by_member(self, split: str, indices: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """As :meth:`_located`, each source named by its place in the mix."""
        n, members, schedule = self._splits[split]
        idx = np.asarray(indices, np.int64).reshape(-1)
        if not len(idx):
            return []
        if idx.min() < 0 or idx.max() >= n:
            raise IndexError(f"index outside {split} (0..{n - 1})")
        assert schedule is not None  # only a split no source has lacks one, and no index is inside it
        which, k = schedule.locate(idx)
        out = []
        for j in np.unique(which).tolist():
            src = self.sources[members[j]]
            rows = np.flatnonzero(which == j)
            out.append((members[j], k[rows] % src.num_samples(split), rows))
        return out

    def locate(self, split: str, indices: np.ndarray) -> list[str]:
        """``MEMBER: LOCATION`` per sample: the member it is drawn from (:attr:`labels`) and where that
        member says its sample lives (``MEMBER: sample K``, its own index, when the member does not
        know). One ``locate`` per member the indices touch."""
        out = [""] * len(indices)
        for member, local, rows in self._by_member(split, indices):
            label, found = self.labels[member], self.sources[member].locate(split, local)
            for r, k, where in zip(rows.tolist(), local.tolist(), found):
                out[r] = f"{label}: {where or f'sample {k}'}"
        return out

    def read_fields(self, split: str, indices: np.ndarray, epoch: int = 0) -> FieldBatch:
        """Named fields: one ``read_fields`` per source the batch touches, gathered into batch order."""
        if self._fields is None:
            return super().read_fields(split, indices, epoch)
        parts = [(rows, src.read_fields(split, local, epoch)) for src, local, rows in self._located(split, indices)]
        return gather(self._fields, len(indices), parts)

    def read(self, split: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Samples as their sources ``read`` them: what a pipeline's source stage asks, and the only
        way to read sources without a fixed shape (encoded images or text for ``decode`` or ``tokenize``)."""
        x = np.empty((len(indices), *self.sample_shape), self.dtype)
        y = np.empty((len(indices), *self.label_shape), self.label_dtype)
        for src, local, rows in self._located(split, indices):
            xs, ys = src.read(split, local)
            x[rows] = xs
            if self.label_shape != (0,):
                y[rows] = np.asarray(ys).reshape(len(rows), *self.label_shape)
        return x, y

    def read_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        self.serve_into(split, indices, x, y)

    def close(self) -> None:
        for src in self.sources:
            src.close()

    def serve_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray, *, epoch: int = 0) -> None:
        """Samples ``indices`` of the mix: one read per source the batch touches (``epoch`` goes
        on to members whose bytes depend on it: pipelines with random stages)."""
        for src, local, rows in self._located(split, indices):
            if len(rows) == len(indices):  # the whole batch from one source: straight into x and y
                src.serve_into(split, local, x, y, epoch=epoch)
                continue
            xs = np.empty((len(rows), *self.sample_shape), self.dtype)
            ys = np.empty((len(rows), *self.label_shape), self.label_dtype)
            src.serve_into(split, local, xs, ys, epoch=epoch)
            x[rows] = xs
            y[rows] = ys


# -- named fields: which a mix serves, and a batch gathered from its sources' rows ----------------


def _describe(fields: list[Field]) -> str:
    return ", ".join(f.describe() for f in fields)


def mix_fields(where: str, names: list[str], sources: list[Source]) -> list[Field] | None:
    """The fields every source of the mix serves, or ``None`` when all are x/y datasets (the mix
    checks those as it always has). Raises :class:`DatasetError` naming the first source (after the
    first) that disagrees with the first, and the field."""
    first, name0 = sources[0].fields, names[0]
    for name, src in zip(names[1:], sources[1:]):
        theirs = src.fields
        if src.xy != sources[0].xy:
            xy, named = (name, name0) if src.xy else (name0, name)
            raise DatasetError(
                f"{where}: {xy} is an x/y dataset but {named} has named fields "
                f"({_describe(first if named == name0 else theirs)}); every source of a mix must serve "
                "the same fields"
            )
    if sources[0].xy:
        return None
    for name, src in zip(names[1:], sources[1:]):
        theirs = src.fields
        if [f.name for f in theirs] != [f.name for f in first]:
            raise DatasetError(
                f"{where}: {name} has fields {', '.join(f.name for f in theirs)} but {name0} has "
                f"{', '.join(f.name for f in first)}; every source of a mix must serve the same fields, in order"
            )
        for mine, other in zip(first, theirs):
            if (mine.dtype, mine.shape if not mine.opaque else ()) != (
                other.dtype,
                other.shape if not other.opaque else (),
            ):
                raise DatasetError(
                    f"{where}: {name} has field {other.describe()} but {name0} has {mine.describe()}; "
                    "every source of a mix must agree on each field's dtype and shape"
                )
    out = []
    for i, f in enumerate(first):
        declared = [s.fields[i].max_bytes for s in sources]
        out.append(Field(f.name, f.dtype, f.shape, max(declared) if f.variable and all(declared) else 0))
    return out


def gather(fields: list[Field], n: int, parts: list[tuple[np.ndarray, FieldBatch]]) -> FieldBatch:
    """A batch of ``n`` samples from ``parts``: (the batch rows a source read, what it read)."""
    out: FieldBatch = {}
    for f in fields:
        if f.variable:
            values: list = [None] * n
            for rows, batch in parts:
                for r, v in zip(rows.tolist(), batch[f.name]):
                    values[r] = v
            out[f.name] = values
        else:
            # a fixed-size field here (variable ones took the branch above): its shape holds ints only
            arr = np.empty((n, *f.fixed_shape), f.np_dtype)
            for rows, batch in parts:
                arr[rows] = batch[f.name]
            out[f.name] = arr
    return out


def _entry(
    uri: str, where: str, entry, named: Mapping[str, Source], open_source: Callable[[str], Source]
) -> tuple[str, Source, object]:
    if not isinstance(entry, dict):
        raise DatasetError(f"{where}: expected a table with uri or dataset, and weight")
    if unknown := entry.keys() - ENTRY_KEYS:
        raise DatasetError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; expected uri or dataset, and weight")
    weight = entry.get("weight")
    if weight is not None and (
        isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0 or not math.isfinite(weight)
    ):
        raise DatasetError(f"{where}: weight must be a positive number, got {weight!r}")
    if ("uri" in entry) == ("dataset" in entry):
        raise DatasetError(
            f"{where}: give either uri (a dataset URI) or dataset (a name this provider serves), not both or neither"
        )
    if "dataset" in entry:
        name = entry["dataset"]
        if name not in named:
            raise DatasetError(
                f"{where}: dataset {name!r} is not served by this provider before the mix; "
                f"give it first with --dataset {name}=URI (served so far: "
                f"{', '.join(named) or 'none'})"
            )
        return f"{where} (dataset {name!r})", named[name], weight
    sub = entry["uri"]
    if not isinstance(sub, str) or sub.startswith("weighted:"):
        raise DatasetError(
            f"{where}: uri must be a dataset URI string other than weighted:// (to nest a "
            "mix, serve it under a name and give dataset = NAME)"
        )
    try:
        return f"{where} ({sub})", open_source(sub), weight
    except DatasetError as err:
        raise DatasetError(f"{where}: {err}") from err


def open_weighted(req: OpenRequest) -> Mix:
    """The mix a ``weighted://FILE.toml`` URI names. Raises :class:`DatasetError` naming the file and
    the entry at fault: unreadable TOML, a bad entry, sources that disagree, weights on only some."""
    uri, parts = req.uri, req.parts
    path = Path(unquote(parts.path if parts.netloc in ("", "localhost") else parts.netloc + parts.path))
    try:
        toml = tomllib.loads(path.read_text())
    except OSError as err:
        raise DatasetError(f"{uri}: cannot read {path}: {err.strerror}") from err
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise DatasetError(f"{path}: not valid TOML: {err}") from err
    if unknown := toml.keys() - {"sources"}:
        raise DatasetError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}; expected [[sources]] tables")
    entries = toml.get("sources")
    if not isinstance(entries, list) or not entries:
        raise DatasetError(f"{path}: no [[sources]]; a mix needs at least one source")
    opened = [_entry(uri, f"{path} source {i + 1}", e, req.named, req.open) for i, e in enumerate(entries)]
    weights = [w for _, _, w in opened]
    if any(w is None for w in weights) and any(w is not None for w in weights):
        raise DatasetError(f"{path}: give every source a weight, or none (then each weighs its length)")
    labels = [e["dataset"] if "dataset" in e else f"source {i + 1}" for i, e in enumerate(entries)]
    return Mix(
        uri, [n for n, _, _ in opened], [s for _, s, _ in opened], None if weights[0] is None else weights, labels
    )
