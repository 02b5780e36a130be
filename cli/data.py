"""``busctl datasets`` and ``busctl fetch``: what the providers serve, and what a trainer will see.

Both ask the router (as admin) which providers serve what: ``ListPeers`` names every provider and its
datasets, ``Resolve`` gives a dataset's DatasetInfo. No message of their own is needed. ``fetch`` then
asks one provider for samples by index with a plain ``BatchRequest`` over its data socket, exactly as a
trainer's loader does (without shared memory), so the private test split is refused the same way.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from rich.table import Table

from libbus.config import Settings
from libbus.connect.client import Client
from libbus.errors import BusError
from libbus.security.curve import curve_key_of
from libbus.wire.fields import decode_frames, fields_of_info, is_xy
from libbus.wire.messages import BatchRequest, BatchResponse, Resolve, frame_buffer
from services import views
from services.views import DatasetRow

from .connection import admin_client
from .output import SafeConsole, fail, print_json

__all__ = [
    "OUT_SUFFIXES",
    "datasets_command",
    "fetch_command",
    "list_datasets",
    "parse_indices",
    "split_pieces",
]

#: Dataset names, URIs and class names are printed as they are (control characters escaped): no rich markup or :emoji: codes.
console = SafeConsole(markup=False, emoji=False, highlight=False, soft_wrap=True)

#: What ``--out`` can write, by file suffix.
OUT_SUFFIXES = {".npz": "x, y and indices", ".npy": "the samples x only"}


# -- datasets ------------------------------------------------------------------------------------


def list_datasets(settings: Settings) -> list[DatasetRow]:
    """Every dataset a connected provider serves (:func:`services.views.datasets`)."""
    with admin_client(settings) as client:
        return views.datasets(client)


def _decode_cache(caches: dict) -> list[str]:
    """One line per provider: the dataset's samples in its decode cache and how often they were there."""
    lines = []
    for provider, c in sorted(caches.items()):
        lookups = c.get("hits", 0) + c.get("misses", 0)
        rate = f"hit rate {c.get('hit_rate', 0):.1%}" if lookups else "no reads yet"
        lines.append(
            f"{provider}: {c.get('entries', 0):,} samples, {_mb(c.get('bytes', 0))} "
            f"(cache {_mb(c.get('cache_bytes', 0))} of {_mb(c.get('limit_bytes', 0))}); "
            f"hits {c.get('hits', 0):,}, misses {c.get('misses', 0):,}, {rate}"
            + (
                f"; final outputs: hits {c['final_hits']:,}, misses {c['final_misses']:,}"
                if c.get("final_hits", 0) + c.get("final_misses", 0)
                else ""
            )
        )
    return lines


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _splits(info: dict) -> str:
    parts = []
    for split, s in info.get("splits", {}).items():
        note = "" if s.get("available", True) else " (private: provider-side evaluation only)"
        if split == "val" and info.get("val_fraction") is not None:  # the files hold no val split
            how = info.get("val_carved", "the tail of train")
            note = f" (carved from train: {how}, val_fraction {info['val_fraction']:g}; the files hold no val)"
        elif split == "test" and s.get("available"):
            note = " (readable: private_test=false)"
        parts.append(f"{split} {s.get('num_samples', '?')}{note}")
    return ", ".join(parts) or "-"


def _labels(info: dict) -> str:
    if info.get("kind") == "tokens":
        vocab = info.get("vocab_size") or info.get("num_classes")
        return f"none (next-token targets); seq_len {info.get('seq_len', '?')}, vocab {vocab}"
    names = info.get("class_names") or []
    shape = tuple(info.get("label_shape", []))
    text = f"{info.get('label_dtype', '?')}{f' {shape}' if shape else ''}, {info.get('num_classes', 0)} classes"
    if names and names != [str(i) for i in range(len(names))]:  # "0".."9" says nothing new
        text += ": " + ", ".join(names[:10]) + (", …" if len(names) > 10 else "")
    return text


def print_datasets(rows: list[DatasetRow]) -> None:
    """One block per dataset, ``key  value`` lines: readable at any terminal width."""
    if not rows:
        console.print("no datasets: no provider is connected to the router (busctl peers)")
        return
    for n, row in enumerate(rows):
        info = row["info"]
        if n:
            console.print()
        console.print(f"{row['dataset']}  ({info.get('kind', 'image')})")
        for p in row["providers"]:
            host = (p.get("host_id") or "?")[:12]
            console.print(f"  provider   {p['name']} at {p['endpoint']} (host {host})")
        source = info.get("uri", "-")
        extra = [f"{k} {info[k]}" for k in ("format", "memory") if info.get(k)]
        console.print(f"  source     {source}" + (f" ({', '.join(extra)})" if extra else ""))
        if info.get("stages"):  # a pipeline: its stages in order, from its source_uri
            console.print(
                f"  stages     {info.get('source_uri', '?')} -> "
                + " -> ".join(f"{s['name']} ({s['type']})" for s in info["stages"][1:])
            )
        console.print(f"  splits     {_splits(info)}")
        if isinstance(row.get("evaluations_left_today"), int):  # the router's count, for every replica
            console.print(f"  test evals {row['evaluations_left_today']} left today (eval_per_dataset_day)")
        for line in _decode_cache(row.get("decode_cache") or {}):
            console.print(f"  cache      {line}")
        if info.get("pack"):
            console.print(f"  packing    {_packing(info['pack'])}")
        fields = _fields(info)
        if fields is not None:
            console.print(f"  fields     {', '.join(f.describe() for f in fields)}")
        if fields is None or is_xy(fields):
            console.print(f"  samples    {tuple(info.get('sample_shape', []))} {info.get('dtype', '?')}")
            console.print(f"  labels     {_labels(info)}")


def _packing(pack: dict) -> str:
    """A joining ``pack`` stage's index (docs/datasets.md §9.4): per split, documents → samples."""
    splits = "; ".join(
        f"{split} {v['documents']:,} documents, {v['tokens']:,} tokens -> {v['samples']:,} samples"
        + (f" ({v['dropped']:,} tokens left over)" if v.get("dropped") else "")
        for split, v in pack.get("splits", {}).items()
    )
    return f"documents joined into samples of {pack['length'] + 1} tokens: {splits}"


def _fields(info: dict) -> list | None:
    """The fields a DatasetInfo describes (``?``: a varying dimension, ``*``: bytes/str), or
    ``None`` when a provider sent none that make sense."""
    try:
        return fields_of_info(info)
    except (BusError, KeyError, TypeError, ValueError):
        return None


def datasets_command(settings: Settings, json: bool = False) -> None:
    """``busctl datasets``: list them, as a table or (``json``) the raw DatasetInfo."""
    rows = list_datasets(settings)
    print_json(rows) if json else print_datasets(rows)


# -- fetch ---------------------------------------------------------------------------------------


def split_pieces(text: str) -> list[tuple[int | None, int | None, int | None] | int]:
    """Check the syntax of ``--indices``: comma-separated ``I``, ``A:B`` or ``A:B:STEP`` (ends optional).

    Returns the pieces (an int, or a ``(start, stop, step)`` slice with ``None`` for a missing part).
    Raises ``ValueError`` saying which piece is wrong.
    """
    pieces: list = []
    if not text.strip():
        raise ValueError("no indices given; use e.g. 0:8, 0:100:10 or 3,7,9")
    for raw in text.split(","):
        piece = raw.strip()
        parts = piece.split(":")
        try:
            value: int | tuple[int | None, ...]
            if len(parts) == 1:
                value = int(piece)
            elif len(parts) in (2, 3):
                value = tuple(int(p) if p.strip() else None for p in parts) + (None,) * (3 - len(parts))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"{piece!r} is not an index, A:B or A:B:STEP") from None
        numbers = [value] if isinstance(value, int) else [v for v in value if v is not None]
        if any(v < 0 for v in numbers):
            raise ValueError(f"{piece!r}: indices and steps are counted from 0 and cannot be negative")
        if isinstance(value, tuple) and value[2] == 0:
            raise ValueError(f"{piece!r}: step cannot be 0")
        pieces.append(value)
    return pieces


def parse_indices(text: str, num_samples: int) -> np.ndarray:
    """The int64 indices ``--indices`` names in a split of ``num_samples`` samples.

    ``A:B`` is ``A, A+1, …, B-1`` (``A`` defaults to 0, ``B`` to the split's end), ``A:B:STEP`` takes
    every STEP-th, and pieces joined by commas are concatenated in order (``3,7,9``, ``0:4,100``).
    Raises ``ValueError`` naming the piece that is malformed or outside ``0..num_samples-1``.
    """
    out: list[np.ndarray] = []
    for piece in split_pieces(text):
        if isinstance(piece, int):
            if piece >= num_samples:
                raise ValueError(
                    f"index {piece} is outside the split (0..{num_samples - 1})"
                    if num_samples
                    else "the split is empty"
                )
            out.append(np.array([piece], dtype=np.int64))
            continue
        start, stop, step = piece
        start = 0 if start is None else start
        stop = num_samples if stop is None else stop
        if stop > num_samples or (start >= num_samples and stop > start):
            raise ValueError(f"{start}:{stop} reaches past the split's end ({num_samples} samples)")
        out.append(np.arange(start, stop, step or 1, dtype=np.int64))
    indices = np.concatenate(out) if out else np.empty(0, np.int64)
    if not len(indices):
        raise ValueError(f"{text!r} selects no samples")
    return indices


def _arrays(reply: BatchResponse) -> tuple[np.ndarray, np.ndarray]:
    out = []
    for frame, shape, dtype in zip(reply.frames, reply.shapes, reply.dtypes):
        buf = frame_buffer(frame)
        out.append(np.frombuffer(buf, np.dtype(dtype)).reshape(shape).copy())
    return out[0], out[1]


def fetch(
    settings: Settings, dataset: str, split: str, indices_text: str, epoch: int = 0
) -> tuple[dict, dict, np.ndarray, dict[str, np.ndarray] | tuple[np.ndarray, np.ndarray]]:
    """Samples ``indices_text`` of ``split`` from a provider of ``dataset``, as a trainer would read them
    in ``epoch`` (which only a pipeline dataset's random stages look at).

    Returns ``(info, provider, indices, batch)``: ``batch`` is ``(x, y)``, or a dict of named fields.
    Exits with a one-line error for bad ``--indices`` or an unknown split; provider errors (``SPLIT_PRIVATE`` for ``test``, ``TOO_LARGE``…) are raised as
    their :class:`~libbus.errors.BusError` for the command's guard to print.
    """
    try:
        split_pieces(indices_text)  # syntax first: no need to reach the router to refuse "0:x"
    except ValueError as err:
        fail(f"--indices {indices_text!r}: {err}", 2)
    with admin_client(settings) as router:
        resolved = router.request(Resolve(dataset=dataset))
        identity = router.identity
    info = resolved.info
    splits = info.get("splits", {})
    if split not in splits:
        fail(f"dataset {resolved.dataset!r} has no split {split!r}; it has {', '.join(splits)}", 2)
    # Every provider of a name serves the same data: take the first (the router lists them in the order
    # they registered). Not libbus.loader.remote.pick_provider: that module imports torch, 2 s of start-up.
    provider = resolved.providers[0]
    with Client(
        provider["endpoint"],
        identity,
        timeout_s=settings.request_timeout_s,
        retries=settings.request_retries,
        server_key=curve_key_of(provider),
    ) as client:
        if not splits[split].get("available", True):
            # The provider is the authority on what leaves it: ask, and show its refusal (SPLIT_PRIVATE).
            client.request(BatchRequest(dataset=resolved.dataset, split=split, range=[0, 0]))
            fail(f"split {split!r} of {resolved.dataset!r} is not available to remote readers", 1)
        try:
            indices = parse_indices(indices_text, int(splits[split]["num_samples"]))
        except ValueError as err:
            fail(f"--indices {indices_text!r}: {err} in {resolved.dataset}/{split}", 2)
        reply = client.request(BatchRequest.for_indices(indices, dataset=resolved.dataset, split=split, epoch=epoch))
        if reply.names is not None:  # named fields: a dict of them, and no y
            return info, provider, indices, decode_frames(reply.names, reply.shapes, reply.dtypes, reply.frames)
        x, y = _arrays(reply)
    return info, provider, indices, (x, y)


def _label(info: dict, value: np.ndarray) -> str:
    if value.size == 0:
        return "-"
    if value.ndim == 0:
        names = info.get("class_names") or []
        label = int(value) if value.dtype.kind in "iub" else float(value)
        if isinstance(label, int) and 0 <= label < len(names) and names[label] != str(label):
            return f"{label} ({names[label]})"
        return str(label)
    return np.array2string(value, threshold=16, separator=",")


def print_samples(
    dataset: str, split: str, info: dict, provider: dict, indices: np.ndarray, x: np.ndarray, y: np.ndarray
) -> None:
    """Shape and dtype of the batch, then one line per sample: label and a compact summary."""
    console.print(
        f"{dataset}/{split} from {provider['name']} ({provider['endpoint']}): {len(indices)} samples, "
        f"x {tuple(x.shape)} {x.dtype}, y {tuple(y.shape)} {y.dtype}"
    )
    if info.get("kind") == "tokens":
        # The token ids exactly as the model gets them, no eliding: that is what fetch is for.
        for i, row in zip(indices, x):
            console.print(f"{i}: " + " ".join(str(int(t)) for t in row))
        return
    table = Table("index", "label", "min", "mean", "max")
    flat = x.reshape(len(x), -1)
    for i, row, label in zip(indices, flat, y):
        if row.size:
            lo, mean, hi = row.min(), float(row.mean(dtype=np.float64)), row.max()
        else:
            lo = mean = hi = math.nan
        table.add_row(str(int(i)), _label(info, label), f"{lo:.4g}", f"{mean:.4g}", f"{hi:.4g}")
    console.print(table)


def save_samples(out: Path, indices: np.ndarray, x: np.ndarray, y: np.ndarray) -> str:
    """Write the batch to ``out`` (see :data:`OUT_SUFFIXES`); returns what was written."""
    if out.suffix == ".npz":
        np.savez(out, x=x, y=y, indices=indices)
    else:
        np.save(out, x)
    return OUT_SUFFIXES[out.suffix]


def fetch_command(
    settings: Settings,
    dataset: str,
    split: str,
    indices: str,
    out: Path | None = None,
    json: bool = False,
    epoch: int = 0,
) -> None:
    """``busctl fetch``: print samples, or save them to ``out`` (``.npz``: x, y, indices; ``.npy``: x)."""
    if out is not None and out.suffix not in OUT_SUFFIXES:
        fail(f"--out {out}: use a .npz file (x, y and indices) or a .npy file (x only)", 2)
    info, provider, idx, batch = fetch(settings, dataset, split, indices, epoch)
    name = dataset.removeprefix("remote://").strip("/")
    if isinstance(batch, dict):  # named fields
        if out is not None:
            fail(f"--out saves x/y datasets; {name} has named fields: use --json", 2)
        if json:
            print_json(
                {
                    "dataset": name,
                    "split": split,
                    "provider": provider["name"],
                    "indices": idx.tolist(),
                    "fields": {k: _json_field(v) for k, v in batch.items()},
                }
            )
        else:
            print_fields(name, split, provider, idx, batch)
        return
    x, y = batch
    if out is not None:
        what = save_samples(out, idx, x, y)
        console.print(
            f"{name}/{split}: {len(idx)} samples, x {tuple(x.shape)} {x.dtype}, "
            f"y {tuple(y.shape)} {y.dtype} written to {out} ({what})"
        )
    elif json:
        print_json(
            {
                "dataset": name,
                "split": split,
                "provider": provider["name"],
                "indices": idx.tolist(),
                "x_shape": list(x.shape),
                "dtype": x.dtype.name,
                "y_shape": list(y.shape),
                "label_dtype": y.dtype.name,
                "x": x.tolist(),
                "y": y.tolist(),
            }
        )
    else:
        print_samples(name, split, info, provider, idx, x, y)


def _json_field(value) -> list:
    """A field's batch for ``--json``: numbers as nested lists, bytes as hex, text as is."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    return [v.hex() if isinstance(v, bytes) else v if isinstance(v, str) else v.tolist() for v in value]


def _summary(value) -> str:
    """One sample of one field, compactly: a number, text, a byte count, or shape and range."""
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:37] + "...")
    if isinstance(value, bytes):
        return f"{len(value)} bytes"
    if value.ndim == 0:
        return str(value.item())
    if value.size == 0:
        return f"{tuple(value.shape)} empty"
    return f"{tuple(value.shape)} {value.min():.4g}..{value.max():.4g}"


def print_fields(dataset: str, split: str, provider: dict, indices: np.ndarray, batch: dict) -> None:
    """A batch of named fields: one row per sample, one column per field."""
    console.print(f"{dataset}/{split} from {provider['name']} ({provider['endpoint']}): {len(indices)} samples")
    table = Table("index", *batch)
    for row, i in enumerate(indices):
        table.add_row(str(int(i)), *(_summary(v[row]) for v in batch.values()))
    console.print(table)
