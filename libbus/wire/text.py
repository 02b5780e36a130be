"""Peer- and job-made text bounded by the bytes it takes on the wire, not by its characters.

A header is JSON: a Cyrillic character is 2 bytes there, a control character 6 (``\\u0001``). A bound
counted in characters lets a line of 4,096 of them take 24 KiB, and a batch of such lines break the
1 MiB a peer accepts; these bound the encoded bytes instead.
"""

from __future__ import annotations

import orjson

__all__ = ["CUT_MARK", "cut_utf8", "cut_json", "json_size"]

#: Appended where :func:`cut_json` cut a text short.
CUT_MARK = " [...cut]"


def json_size(value: object) -> int:
    """Bytes ``value`` takes as JSON (a string: with its quotes and escapes)."""
    return len(orjson.dumps(value))


def cut_utf8(text: str, max_bytes: int) -> str:
    """``text``'s longest prefix of at most ``max_bytes`` bytes of UTF-8 (never half a character)."""
    if len(text) * 4 <= max_bytes:  # quick: no character takes more than 4 bytes
        return text
    raw = text.encode("utf-8", "replace")
    if len(raw) <= max_bytes:
        return text
    return raw[:max_bytes].decode("utf-8", "ignore")


def cut_json(text: str, max_bytes: int) -> str:
    """``text``, or its longest prefix (marked :data:`CUT_MARK`) whose JSON string takes at most
    ``max_bytes`` bytes, quotes and escapes counted."""
    if json_size(text) <= max_bytes:
        return text
    budget = max(0, max_bytes - json_size(CUT_MARK))
    # a JSON character takes 1 to 6 bytes: search the prefix length (log n encodings, each bounded)
    lo, hi = 0, min(len(text), budget)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if json_size(text[:mid]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo] + CUT_MARK
