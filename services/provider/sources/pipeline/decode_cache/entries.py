"""What the decode cache keeps and under which key: an :class:`Entry` (a sample's value and its label),
the two kinds of keys (a decoded sample's and a pipeline's final output's, :func:`is_final`), the digest
of the stages that made a sample (:func:`prefix_digest`), an entry's size in bytes, and the order in which
entries make room for a new one (:func:`make_room`), which the RAM and the disk tier both follow."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["OBJECT_KINDS", "Entry", "is_final", "is_image", "key_text", "make_room", "prefix_digest"]

#: Sample kinds held as one Python object per sample (a Pillow image, a token list), not array rows.
OBJECT_KINDS = ("encoded", "decoded", "token_lists")
#: Stage parameters that change how a stage runs, not what it produces: left out of the digest.
_NOT_OUTPUT = frozenset({"workers"})
#: A final-output key is ``(dataset, split, index, digest, random state)``; a decoded one has no state.
_FINAL_KEY_LEN = 5


def is_final(key: tuple) -> bool:
    """Whether ``key`` names a pipeline's final output (:class:`~.pipeline_bindings.FinalCache`), not a
    decoded sample."""
    return len(key) == _FINAL_KEY_LEN


def make_room(
    decoded: OrderedDict, final: OrderedDict, used: int, final_used: int, limit: int, size: int, is_fin: bool
):
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


def is_image(value: Any) -> bool:
    """Whether ``value`` is a Pillow image (told by its methods: Pillow is imported only to decode)."""
    return hasattr(value, "getbands") and hasattr(value, "tobytes") and hasattr(value, "size")


def _value_bytes(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if is_image(value):
        w, h = value.size
        # Pillow keeps RGB, RGBA, CMYK … as 4 bytes a pixel, L/P/1 as one
        return w * h * (1 if len(value.getbands()) == 1 else 4)
    return 1024  # another object (a token list …): counted at a nominal size; RAM tier only


def prefix_digest(stages: list) -> str:
    """A hex digest of what ``stages`` (a pipeline's deterministic prefix) produce: their types and
    parameters in order, the source's URI among them."""
    parts = [(s.type, s.name, {k: v for k, v in sorted(s.config.items()) if k not in _NOT_OUTPUT}) for s in stages]
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


def key_text(key: tuple) -> str:
    """``key`` as one string (the disk tier's file names and headers)."""
    return "\x1f".join(str(part) for part in key)
