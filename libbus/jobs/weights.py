"""The weights digest: one hash of a model's tensors, apart from the file that holds them.

A safetensors file's sha256 covers its metadata too, and a job's model file names its job there: two
runs that end with bit-identical weights (one resumed after a crash, one not) have different sha256s.
:func:`weights_digest` hashes only the canonical tensors — each one's name, dtype, shape and bytes, in
name order — so it is equal exactly when the weights are. It reads the safetensors layout itself
(8 bytes of header length, a JSON header, the data), so neither the router nor busctl needs torch.
"""

from __future__ import annotations

import hashlib

import orjson

__all__ = ["weights_digest"]

#: Bytes hashed per update: a large tensor is not copied whole.
_CHUNK = 1 << 24


def weights_digest(data: bytes | memoryview) -> str:
    """sha256 (hex) of the tensors of a safetensors blob: per tensor, sorted by name, a JSON line of
    ``[name, dtype, shape, nbytes]`` then its bytes. The file's ``__metadata__`` is not part of it.

    Raises:
        ValueError: ``data`` is not a safetensors blob (a short or unreadable header, a tensor whose
            offsets lie outside the data).
    """
    view = memoryview(data).cast("B")
    if len(view) < 8:
        raise ValueError(f"not a safetensors file: {len(view)} bytes, shorter than its header's length")
    size = int.from_bytes(view[:8], "little")
    if size > len(view) - 8:
        raise ValueError(f"not a safetensors file: a header of {size} bytes in a file of {len(view)}")
    try:
        header = orjson.loads(bytes(view[8 : 8 + size]))
    except orjson.JSONDecodeError as err:
        raise ValueError(f"not a safetensors file: its header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file: its header is not a JSON object")
    body = view[8 + size :]
    digest = hashlib.sha256()
    for name in sorted(k for k in header if k != "__metadata__"):
        entry = header[name]
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"not a safetensors file: tensor {name!r} lacks dtype, shape or data_offsets") from None
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= len(body)):
            raise ValueError(f"not a safetensors file: tensor {name!r} lies outside the data ({begin}:{end})")
        digest.update(orjson.dumps([name, dtype, shape, end - begin]) + b"\n")
        for at in range(begin, end, _CHUNK):
            digest.update(body[at : min(end, at + _CHUNK)])
    return digest.hexdigest()
