"""libbus: the batchbus wire — frames and messages, errors, auth, sockets, sessions, config — and
the public API of a training script.

A script needs only this package's face::

    from libbus import RemoteLoader, as_float, merge_cursors, errors

``RemoteLoader`` and the other torch-based names are imported on first use (PEP 562), so
``import libbus`` stays light for services that never load data (the router imports no torch);
their types are declared in ``__init__.pyi`` (an import here would close a cycle: the wire modules
import this package's ``PROTOCOL``).
libbus imports zmq, never ``services`` or ``cli``.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import errors

#: The wire tag, ``BB`` + the wire version. 2: batches carry named fields (issue 15).
PROTOCOL = b"BB2"
VERSION = "0.1.0"

#: Public name -> the module that defines it (imported when the name is first used).
_LAZY = {
    "RemoteLoader": "libbus.loader",
    "merge_cursors": "libbus.elastic",
    "as_float": "libbus.tensors",
    "RankInfo": "libbus.ranks",
    "detect_rank": "libbus.ranks",
    "StallMeter": "libbus.stall",
}

__all__ = [
    "PROTOCOL",
    "VERSION",
    "RankInfo",
    "RemoteLoader",
    "StallMeter",
    "as_float",
    "detect_rank",
    "errors",
    "merge_cursors",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'libbus' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), "detect" if name == "detect_rank" else name)
    globals()[name] = value
    return value
