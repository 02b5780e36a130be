"""Samples with named fields: the field model, and a batch's fields as frames or as one ring slot.

A dataset's samples are a list of named :class:`Field`\\ s, each with a dtype and a per-sample shape:

- **fixed**: every sample has the same shape, e.g. ``x`` ``float32 (1, 28, 28)``;
- **variable**: some dimensions vary per sample (``None`` in the shape, shown ``?``), e.g. an image
  ``uint8 (?, ?, 3)`` or a token list ``int32 (?,)``;
- **bytes** / **str**: one byte string or text per sample (shown ``*``).

A batch of a field travels as its values (all samples' bytes back to back) and, for a variable
field, an *index*: int64 little-endian, ``n + 1`` byte offsets into the values (``0`` first, the
values' length last, never decreasing), then for arrays ``n × ndim`` per-sample shapes. Everything a
peer sends is checked before it is viewed: an offset or shape that does not add up is a
:class:`BusError` naming the field, never an out-of-bounds read. On the sending side, a sample
beyond its field's declared ``max_bytes``, or a batch beyond its ring slot, is :class:`TooLarge`.

Over the socket, each field is its values frame followed (variable fields) by its index frame. In a
ring slot the same pieces lie back to back from the slot's start, each at a 64-byte boundary: index,
then values, field by field (:func:`pack_slot`, :func:`unpack_slot`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from libbus.errors import BusError, TooLarge
from libbus.wire.dataset_info import FieldInfo

__all__ = [
    "Field",
    "FieldBatch",
    "XY",
    "decode_frames",
    "encode_frames",
    "fields_of_info",
    "is_xy",
    "pack_slot",
    "slot_bytes_for",
    "unpack_slot",
]

#: dtypes of one byte string or one text per sample.
OPAQUE = ("bytes", "str")
#: The names of a two-field dataset served as ``(x, y)``.
XY = ("x", "y")
_ALIGN = 64
_I8 = np.dtype("<i8")

#: A batch of fields: name → a batch array (fixed), a list of per-sample arrays (variable), or a
#: list of bytes / str.
FieldBatch = dict[str, Any]


def _round_up(n: int, to: int = _ALIGN) -> int:
    return -(-n // to) * to


def _raw(buf) -> memoryview:
    """A flat byte view of ``buf`` (bytes, or a C-contiguous array, empty ones included)."""
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8).data
    return memoryview(buf).cast("B")


@dataclass(frozen=True)
class Field:
    """One named field of a sample.

    ``dtype`` is a numpy dtype name (``"float32"``), or ``"bytes"`` / ``"str"``. ``shape`` is the
    per-sample shape, ``None`` for a dimension that varies (ignored for bytes/str). ``max_bytes``
    is the most bytes one sample of a variable field may hold: it sizes shared-memory ring slots
    (0: undeclared, and such datasets travel over the socket).
    """

    name: str
    dtype: str
    shape: tuple[int | None, ...] = ()
    max_bytes: int = 0

    @property
    def opaque(self) -> bool:
        """Bytes or text: no dtype, no shape."""
        return self.dtype in OPAQUE

    @property
    def variable(self) -> bool:
        return self.opaque or any(d is None for d in self.shape)

    @property
    def fixed_shape(self) -> tuple[int, ...]:
        """``shape`` of a fixed field (every dimension known). Raises :class:`BusError` for a variable one."""
        dims = tuple(d for d in self.shape if d is not None)
        if self.opaque or len(dims) != len(self.shape):
            raise BusError(f"field {self.name!r} has no fixed shape ({self.describe()})")
        return dims

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(np.uint8) if self.opaque else np.dtype(self.dtype)

    @property
    def sample_nbytes(self) -> int:
        """Bytes of one sample: exact for a fixed field, the declared maximum for a variable one."""
        if self.variable:
            return self.max_bytes
        return math.prod(self.fixed_shape) * self.np_dtype.itemsize

    @property
    def ndim(self) -> int:
        return 0 if self.opaque else len(self.shape)

    def describe(self) -> str:
        """``name dtype shape`` as ``busctl`` shows it: ``?`` a variable dimension, ``*`` bytes/str."""
        if self.opaque:
            return f"{self.name} {self.dtype} *"
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.name} {self.dtype} ({dims}{',' if len(self.shape) == 1 else ''})"

    def to_info(self) -> FieldInfo:
        out: FieldInfo = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if self.variable:
            out["max_bytes"] = self.max_bytes
        return out

    @classmethod
    def from_info(cls, d: Any) -> Field:
        """A field from a DatasetInfo ``fields`` entry (a peer's: checked). Raises :class:`BusError`."""
        if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not d["name"]:
            raise BusError(f"malformed field in DatasetInfo: {d!r:.200}")
        dtype, shape, max_bytes = d.get("dtype"), d.get("shape", []), d.get("max_bytes", 0)
        if not isinstance(dtype, str) or not isinstance(shape, list) or not isinstance(max_bytes, int):
            raise BusError(f"malformed field {d['name']!r} in DatasetInfo: {d!r:.200}")
        if dtype not in OPAQUE:
            try:
                if np.dtype(dtype).kind not in "biufc":
                    raise TypeError(dtype)
            except TypeError:
                raise BusError(
                    f"field {d['name']!r} has dtype {dtype!r}; expected a numeric dtype, bytes or str"
                ) from None
        if not all(s is None or (isinstance(s, int) and not isinstance(s, bool) and s >= 0) for s in shape):
            raise BusError(f"field {d['name']!r} has shape {shape!r}; expected sizes >= 0 or null (variable)")
        return cls(d["name"], dtype, tuple(shape), max(0, max_bytes))


def fields_of_info(info: dict) -> list[Field]:
    """A DatasetInfo's fields: its ``fields`` list, or (an x/y dataset described the old way) ``x``
    and ``y`` from ``sample_shape``/``dtype``/``label_shape``/``label_dtype``."""
    if "fields" in info:
        raw = info["fields"]
        if not isinstance(raw, list) or not raw:
            raise BusError("DatasetInfo.fields must be a non-empty list")
        fields = [Field.from_info(d) for d in raw]
        if len({f.name for f in fields}) != len(fields):
            raise BusError(f"DatasetInfo.fields repeats a name: {[f.name for f in fields]}")
        return fields
    return [
        Field("x", str(info["dtype"]), tuple(info["sample_shape"])),
        Field("y", str(info.get("label_dtype", "int64")), tuple(info.get("label_shape") or [])),
    ]


def is_xy(fields: list[Field]) -> bool:
    """Exactly two fixed fields ``x`` and ``y``: served and yielded as before, ``(x, y)``."""
    return tuple(f.name for f in fields) == XY and not any(f.variable for f in fields)


# -- a batch of fields → pieces --------------------------------------------------------------------


def _pieces(field: Field, value: Any, n: int) -> tuple[list, str, list[int]]:
    """(buffers, dtype str, batch shape) of one field's batch: values, and for variable fields the
    index before them. Raises :class:`BusError` for a value that is not what the field declares."""
    if not field.variable:
        arr = np.ascontiguousarray(value, dtype=field.np_dtype)
        want = (n, *field.fixed_shape)
        if arr.shape != want:
            raise BusError(f"field {field.name!r}: batch has shape {arr.shape}; the field declares {want}")
        return [arr], arr.dtype.str, list(want)
    if len(value) != n:
        raise BusError(f"field {field.name!r}: {len(value)} samples in a batch of {n}")
    if field.opaque:
        items = [v.encode() if isinstance(v, str) else bytes(v) for v in value]
        sizes = [len(b) for b in items]
        shapes: list[tuple] = []
        arrays: list = items
    else:
        arrays = [np.ascontiguousarray(v, dtype=field.np_dtype) for v in value]
        shapes = [a.shape for a in arrays]
        for s in shapes:
            if len(s) != field.ndim or any(d is not None and d != g for d, g in zip(field.shape, s)):
                raise BusError(f"field {field.name!r}: a sample has shape {s}; the field declares {field.shape}")
        sizes = [a.nbytes for a in arrays]
    index = np.empty(n + 1 + n * field.ndim, _I8)
    index[0] = 0
    np.cumsum(sizes, out=index[1 : n + 1])
    if field.ndim:
        index[n + 1 :] = np.asarray(shapes, dtype=_I8).reshape(-1)
    if field.max_bytes and sizes and max(sizes) > field.max_bytes:
        worst = int(np.argmax(sizes))
        raise TooLarge(
            f"field {field.name!r}: sample {worst} of the batch holds {sizes[worst]} bytes; "
            f"the field declares at most {field.max_bytes} (max_bytes)"
        )
    values = b"".join(arrays) if field.opaque else b"".join(a.data for a in arrays)
    shape = [n, *(-1 if d is None else d for d in field.shape)]
    return [index, values], field.dtype if field.opaque else field.np_dtype.str, shape


def encode_frames(fields: list[Field], batch: FieldBatch, n: int) -> tuple[list, list, list, int]:
    """``(frames, shapes, dtypes, nbytes)`` of a BatchResponse carrying ``batch`` (``n`` samples)."""
    frames: list = []
    shapes, dtypes, nbytes = [], [], 0
    for field in fields:
        if field.name not in batch:
            raise BusError(f"the batch lacks field {field.name!r}")
        bufs, dtype, shape = _pieces(field, batch[field.name], n)
        if len(bufs) == 2:
            bufs = [bufs[1], bufs[0]]  # on the wire: values, then index
        frames += [b if isinstance(b, bytes) else _raw(b) for b in bufs]
        shapes.append(shape)
        dtypes.append(dtype)
        nbytes += sum(_raw(b).nbytes for b in bufs)
    return frames, shapes, dtypes, nbytes


def slot_bytes_for(fields: list[Field], batch_size: int) -> int | None:
    """Bytes of a ring slot that holds any batch of ``batch_size`` within the declared maxima, or
    ``None`` when a variable field declares no maximum."""
    total = 0
    for f in fields:
        if f.variable and not f.max_bytes:
            return None
        if f.variable:
            total += _round_up(8 * (batch_size + 1 + batch_size * f.ndim))
        total += _round_up(batch_size * f.sample_nbytes)
    return total


def pack_slot(fields: list[Field], batch: FieldBatch, n: int, buf: memoryview) -> tuple[list, list, int]:
    """Write ``batch`` into the slot ``buf`` (see the module doc). Returns ``(shapes, dtypes,
    nbytes)``. Raises :class:`BusError` naming the field and sizes when it does not fit."""
    pos, shapes, dtypes, nbytes = 0, [], [], 0
    for field in fields:
        if field.name not in batch:
            raise BusError(f"the batch lacks field {field.name!r}")
        bufs, dtype, shape = _pieces(field, batch[field.name], n)
        for b in bufs:
            raw = _raw(b)
            size = raw.nbytes
            if pos + size > len(buf):
                raise TooLarge(
                    f"batch does not fit the ring slot: field {field.name!r} needs {size} bytes at offset "
                    f"{pos}; the slot holds {len(buf)} (sized for max_bytes {field.max_bytes} per sample)"
                )
            buf[pos : pos + size] = raw
            pos = _round_up(pos + size)
            nbytes += size
        shapes.append(shape)
        dtypes.append(dtype)
    return shapes, dtypes, nbytes


# -- pieces → a batch of fields (what a peer sent: checked) -----------------------------------------


def _field_of(name: str, shape: Any, dtype: Any) -> tuple[Field, int]:
    """The field a BatchResponse describes, and its sample count."""
    if not isinstance(shape, list) or not shape or not all(isinstance(d, int) and d >= -1 for d in shape):
        raise BusError(f"malformed BatchResponse: field {name!r} has shape {shape!r:.80}")
    if not isinstance(dtype, str):
        raise BusError(f"malformed BatchResponse: field {name!r} has dtype {dtype!r:.80}")
    n = shape[0]
    if n < 0:
        raise BusError(f"malformed BatchResponse: field {name!r} has {n} samples")
    if dtype in OPAQUE:
        return Field(name, dtype), n
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise BusError(f"malformed BatchResponse: field {name!r} has dtype {dtype!r:.80}") from None
    if dt.kind not in "biufc" or dt.hasobject:
        raise BusError(f"malformed BatchResponse: field {name!r} has dtype {dtype!r:.80}")
    return Field(name, dt.str, tuple(None if d == -1 else d for d in shape[1:])), n


def _index(field: Field, n: int, raw) -> np.ndarray:
    want = 8 * (n + 1 + n * field.ndim)
    if memoryview(raw).nbytes != want:
        raise BusError(
            f"malformed BatchResponse: field {field.name!r} index is {memoryview(raw).nbytes} bytes; "
            f"{n} samples of {field.ndim} dims need {want}"
        )
    return np.frombuffer(raw, _I8)


def _unpack(field: Field, n: int, index: np.ndarray | None, values, copy: bool) -> Any:
    """One field's batch from its index and values (both already bounded)."""
    size = memoryview(values).nbytes
    if index is None:
        want = n * field.sample_nbytes
        if size != want:
            raise BusError(f"malformed BatchResponse: field {field.name!r} is {size} bytes; expected {want}")
        arr = np.frombuffer(values, field.np_dtype).reshape((n, *field.fixed_shape))
        return arr.copy() if copy else arr
    offsets = index[: n + 1]
    if offsets[0] != 0 or offsets[-1] != size or (n and bool(np.any(np.diff(offsets) < 0))):
        raise BusError(
            f"malformed BatchResponse: field {field.name!r} offsets must rise from 0 to its {size} value bytes"
        )
    lo, hi = offsets[:-1].tolist(), offsets[1:].tolist()
    if field.opaque:
        raw = bytes(values)
        items = [raw[a:b] for a, b in zip(lo, hi)]
        if field.dtype == "str":
            try:
                return [b.decode() for b in items]
            except UnicodeDecodeError as err:
                raise BusError(f"malformed BatchResponse: field {field.name!r} is not UTF-8: {err}") from None
        return items
    shapes = index[n + 1 :].reshape(n, field.ndim)
    if n and (
        bool(np.any(shapes < 0))
        or any(d is not None and bool(np.any(shapes[:, i] != d)) for i, d in enumerate(field.shape))
    ):
        raise BusError(f"malformed BatchResponse: field {field.name!r} has sample shapes outside {field.shape}")
    item = field.np_dtype.itemsize
    # every sample spans exactly prod(shape) × itemsize bytes: checked in float first (no int64
    # overflow can make a hostile shape pass), then exactly
    spans = np.diff(offsets)
    if n and (
        bool(np.any(np.prod(shapes.astype(np.float64), axis=1) * item > size))
        or bool(np.any(np.prod(shapes, axis=1) * item != spans))
    ):
        wrong = np.flatnonzero(np.prod(shapes.astype(np.float64), axis=1) * item != spans)
        bad = int(wrong[0]) if len(wrong) else 0
        raise BusError(
            f"malformed BatchResponse: field {field.name!r} sample of shape {shapes[bad].tolist()} "
            f"spans {int(spans[bad])} bytes"
        )
    flat = np.frombuffer(values, field.np_dtype)  # size is a sum of whole samples: a multiple of item
    out = []
    for a, b, s in zip(lo, hi, shapes.tolist()):
        arr = flat[a // item : b // item].reshape(s)
        out.append(arr.copy() if copy else arr)
    return out


def _describe(names: Any, shapes: Any, dtypes: Any) -> list[tuple[Field, int]]:
    if not isinstance(names, list) or not all(isinstance(s, str) for s in names) or len(set(names)) != len(names):
        raise BusError("malformed BatchResponse: names must be a list of distinct strings")
    if not isinstance(shapes, list) or not isinstance(dtypes, list) or not len(names) == len(shapes) == len(dtypes):
        raise BusError(f"malformed BatchResponse: {len(names)} names, {len(shapes)} shapes, {len(dtypes)} dtypes")
    described = [_field_of(name, shape, dtype) for name, shape, dtype in zip(names, shapes, dtypes)]
    if len({n for _, n in described}) > 1:
        raise BusError("malformed BatchResponse: fields differ in their sample counts")
    return described


def decode_frames(names: Any, shapes: Any, dtypes: Any, frames: list) -> FieldBatch:
    """The batch a BatchResponse's frames carry (views of them). Raises :class:`BusError`."""
    described = _describe(names, shapes, dtypes)
    want = sum(2 if f.variable else 1 for f, _ in described)
    if len(frames) != want:
        raise BusError(f"malformed BatchResponse: {len(frames)} frames; its fields need {want}")
    out: FieldBatch = {}
    it = iter(frames)
    for field, n in described:
        values = next(it)
        index = _index(field, n, next(it)) if field.variable else None
        out[field.name] = _unpack(field, n, index, values, copy=False)
    return out


def unpack_slot(names: Any, shapes: Any, dtypes: Any, buf: memoryview) -> FieldBatch:
    """The batch in ring slot ``buf`` (copies: the slot can return to the ring at once). Every
    offset is checked against the slot's size first. Raises :class:`BusError`."""
    pos, out = 0, {}
    size = len(buf)

    def take(nbytes: int, what: str) -> memoryview:
        nonlocal pos
        if nbytes < 0 or pos + nbytes > size:
            raise BusError(f"malformed BatchResponse: {what} ends past the {size}-byte ring slot")
        piece = buf[pos : pos + nbytes]
        pos = _round_up(pos + nbytes)
        return piece

    for field, n in _describe(names, shapes, dtypes):
        if not field.variable:
            values = take(n * field.sample_nbytes, f"field {field.name!r}")
            out[field.name] = _unpack(field, n, None, values, copy=True)
            continue
        index = _index(field, n, bytes(take(8 * (n + 1 + n * field.ndim), f"field {field.name!r} index")))
        values = take(int(index[n]), f"field {field.name!r} values")
        out[field.name] = _unpack(field, n, index, values, copy=True)
    return out
