"""Token shards, as the Psyche data provider reads them: ``.bin``, ``.ds`` or ``.npy`` files of 2- or
4-byte little-endian tokens, concatenated in name order. Sample ``i`` is the ``seq_len + 1`` tokens
from token ``i * (seq_len + 1)`` on (the inputs and, shifted by one, the next-token targets); samples
do not overlap, may span two shards, and the tokens left over at the end are not served.

Settings (URI query or ``dataset.toml``): ``seq_len`` (required), ``token_bytes`` (2 or 4; required
for ``.bin``/``.ds``, read from the header of ``.npy`` shards), ``vocab_size`` (default 65536 for
2-byte tokens, required for 4-byte ones: scanning a corpus for its largest token is not an option).
The shards are one train split; val is carved from its tail; there is no test split.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from libbus.errors import DatasetError

from ..storage.reader import ByteSpace, Records
from .dataset import Context, Layout, Table
from .location import Format
from .npy import npy_header

__all__ = ["FORMAT", "detect", "open_tokens", "shards"]

SUFFIXES = (".bin", ".ds", ".npy")
EXPECTED = "token shards (*.bin, *.ds or *.npy, with seq_len set)"


def shards(root: Path) -> list[Path]:
    """The shard files in ``root``, in name order."""
    return sorted(p for p in root.iterdir() if p.suffix in SUFFIXES and not p.name.startswith(".") and p.is_file())


def detect(root: Path) -> bool:
    """Whether ``root`` holds files that can be token shards."""
    return bool(shards(root))


def open_tokens(ctx: Context) -> Layout:
    """The token sequences over the shards in ``ctx.root``; raises :class:`DatasetError` for a
    missing setting, a shard that is not whole tokens, or shards of different token sizes."""
    s, root = ctx.settings, ctx.root
    seq_len, token_bytes = s.get("seq_len"), s.get("token_bytes")
    if not seq_len:
        raise DatasetError(
            f"{root}: token shards need a sequence length: add ?seq_len=N to the URI or seq_len = N to dataset.toml"
        )
    segments = []
    for path in shards(root):
        seg = ctx.segment(path)
        if path.suffix == ".npy":
            dtype, _, seg = npy_header(seg)
            if dtype.kind not in "ui" or dtype.itemsize not in (2, 4) or dtype.byteorder == ">":
                raise DatasetError(f"{path}: tokens must be 2- or 4-byte little-endian integers, found {dtype}")
            size = dtype.itemsize
        else:
            if token_bytes is None:
                raise DatasetError(
                    f"{path}: the token size of .bin/.ds shards is not recorded in them: add "
                    "?token_bytes=2 or 4 to the URI, or token_bytes to dataset.toml"
                )
            size = token_bytes
            if seg.length % size:
                raise DatasetError(
                    f"{path}: {seg.length} bytes is not a whole number of {size}-byte tokens; "
                    "truncated, or token_bytes is wrong"
                )
        if token_bytes is not None and size != token_bytes:
            raise DatasetError(f"{path}: holds {size}-byte tokens but token_bytes is {token_bytes}")
        token_bytes = size
        segments.append(seg)
    if not segments:
        raise DatasetError(f"{root}: no token shards; expected {EXPECTED}")
    assert token_bytes is not None  # each shard set it
    vocab = s.get("vocab_size") or (65536 if token_bytes == 2 else None)
    if vocab is None:
        raise DatasetError(
            f"{root}: 4-byte tokens need vocab_size (the tokenizer's): add ?vocab_size=N "
            "or vocab_size = N to dataset.toml"
        )
    if vocab > 1 << (8 * token_bytes):
        raise DatasetError(f"{root}: vocab_size {vocab} does not fit {token_bytes}-byte tokens")
    space = ByteSpace(segments)
    tokens, record = space.size // token_bytes, (seq_len + 1) * token_bytes
    count = tokens // (seq_len + 1)
    if count == 0:
        raise DatasetError(f"{root}: {tokens} tokens make no whole sequence of seq_len + 1 = {seq_len + 1}")
    table = Table(count, [(Records(space, 0, record, count, [(0, record)]), ["x"])])
    return Layout(
        "tokens",
        {"train": table},
        (seq_len + 1,),
        np.dtype(f"<u{token_bytes}"),
        num_classes=vocab,
        kind="tokens",
        extra={"seq_len": seq_len, "vocab_size": vocab, "token_bytes": token_bytes},
    )


#: This layout's line in the registry (:mod:`..layouts`).
FORMAT = Format("tokens", lambda loc: detect(loc.root), open_tokens, EXPECTED)
