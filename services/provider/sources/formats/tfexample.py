"""``tf.train.Example`` decoded without TensorFlow: the protobuf wire format of the few messages it uses.

An Example is a map from feature names to one of three lists (TensorFlow's ``example.proto``)::

    Example   { Features features = 1; }
    Features  { map<string, Feature> feature = 1; }      // entries: key = 1, value = 2
    Feature   { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3; } }
    BytesList { repeated bytes value = 1; }
    FloatList { repeated float value = 1 [packed = true]; }
    Int64List { repeated int64 value = 1 [packed = true]; }

:func:`parse_example` reads that and nothing else: fields it does not know are skipped by their wire
type, as protobuf does, and packed and unpacked lists are both read (a writer may use either). A
record that is not a well-formed Example raises :class:`ValueError` saying where it went wrong; the
caller names the file and offset.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BYTES", "FLOAT", "INT64", "KINDS", "Feature", "parse_example"]

BYTES, FLOAT, INT64 = "bytes", "float", "int64"
#: The kind of each ``Feature`` field number.
KINDS = {1: BYTES, 2: FLOAT, 3: INT64}

#: One feature's values: ``(kind, values)``, values a list of bytes, or a float32 / int64 array.
Feature = tuple[str, "list[bytes] | np.ndarray"]

_F4 = np.dtype("<f4")
_EMPTY: dict[str, np.ndarray] = {FLOAT: np.empty(0, np.float32), INT64: np.empty(0, np.int64)}


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it."""
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError(f"a varint runs past the end at byte {pos}")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError(f"a varint longer than 10 bytes ends at byte {pos}")


def _fields(buf: bytes, start: int, end: int):
    """``(field number, wire type, value)`` of each field in ``buf[start:end]``: a varint's value, or
    the ``(start, end)`` of a length-delimited or fixed-width field's bytes."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield number, wire, value
            continue
        if wire == 2:
            n, pos = _varint(buf, pos)
            span = (pos, pos + n)
        elif wire == 5:
            span = (pos, pos + 4)
        elif wire == 1:
            span = (pos, pos + 8)
        else:
            raise ValueError(f"field {number} has wire type {wire} (groups are not Example fields) at byte {pos}")
        if span[1] > end:
            raise ValueError(f"field {number} runs past its message's end (byte {span[1]} of {end})")
        pos = span[1]
        yield number, wire, span


def _packed_varints(buf: bytes, start: int, end: int) -> np.ndarray:
    """The varints of ``buf[start:end]`` as int64 (two's complement, as protobuf writes an int64)."""
    b = np.frombuffer(buf, np.uint8, end - start, start)
    last = b < 0x80
    if len(b) and not last[-1]:
        raise ValueError(f"a packed varint runs past its list's end at byte {end}")
    ends = np.flatnonzero(last)
    starts = np.concatenate([[0], ends[:-1] + 1]) if len(ends) else ends
    if len(ends) and int((ends - starts).max()) > 9:
        raise ValueError("a packed varint is longer than 10 bytes")
    group = np.repeat(np.arange(len(ends)), ends - starts + 1)
    shift = ((np.arange(len(b)) - starts[group]) * 7).astype(np.uint64)
    parts = (b & 0x7F).astype(np.uint64) << shift
    return np.add.reduceat(parts, starts).view(np.int64) if len(ends) else np.empty(0, np.int64)


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _list(buf: bytes, start: int, end: int, kind: str) -> list[bytes] | np.ndarray:
    """A BytesList, FloatList or Int64List's values."""
    if kind == BYTES:
        out = []
        for number, wire, value in _fields(buf, start, end):
            if number == 1:
                if wire != 2:
                    raise ValueError(f"a BytesList value has wire type {wire}")
                out.append(buf[value[0] : value[1]])
        return out
    chunks: list[np.ndarray] = []
    single: list = []
    for number, wire, value in _fields(buf, start, end):
        if number != 1:
            continue
        if wire == 2:  # packed
            if kind == FLOAT:
                if (value[1] - value[0]) % 4:
                    raise ValueError(f"a packed FloatList of {value[1] - value[0]} bytes (not whole floats)")
                chunks.append(np.frombuffer(buf, _F4, (value[1] - value[0]) // 4, value[0]))
            else:
                chunks.append(_packed_varints(buf, value[0], value[1]))
        elif kind == FLOAT and wire == 5:
            single.append(np.frombuffer(buf, _F4, 1, value[0])[0])
        elif kind == INT64 and wire == 0:
            single.append(_signed(value))
        else:
            raise ValueError(f"a {kind} list value has wire type {wire}")
    if single:
        chunks.append(np.asarray(single, np.float32 if kind == FLOAT else np.int64))
    if not chunks:
        return _EMPTY[kind]
    joined = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
    return joined.astype(np.float32 if kind == FLOAT else np.int64, copy=False)


def _feature(buf: bytes, start: int, end: int) -> Feature | None:
    """A Feature's kind and values; ``None`` for a Feature with no list set."""
    found: Feature | None = None
    for number, wire, value in _fields(buf, start, end):
        if number in KINDS and wire == 2:
            found = (KINDS[number], _list(buf, value[0], value[1], KINDS[number]))  # a oneof: the last wins
    return found


def parse_example(buf: bytes, wanted: set[str] | frozenset[str] | None = None) -> dict[str, Feature]:
    """The features of the serialized ``tf.train.Example`` ``buf``: name → ``(kind, values)``; only
    those in ``wanted`` when given (the others are skipped, not decoded). A feature with no list set
    is left out. Raises :class:`ValueError` for bytes that are not an Example."""
    out: dict[str, Feature] = {}
    for number, wire, features in _fields(buf, 0, len(buf)):
        if number != 1 or wire != 2:
            continue
        for n2, w2, entry in _fields(buf, features[0], features[1]):
            if n2 != 1 or w2 != 2:
                continue
            key, span = None, None
            for n3, w3, part in _fields(buf, entry[0], entry[1]):
                if n3 == 1 and w3 == 2:
                    key = buf[part[0] : part[1]].decode("utf-8", "replace")
                elif n3 == 2 and w3 == 2:
                    span = part
            if key is None or (wanted is not None and key not in wanted):
                continue
            feature = _feature(buf, *span) if span is not None else None
            if feature is not None:
                out[key] = feature
    return out
