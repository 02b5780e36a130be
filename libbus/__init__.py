"""libbus: the batchbus wire and the public API of a training script, in folders along its seams
(lowest first; ``tests/project/test_layers.py`` holds the order):

- ``errors``, ``constants``: the one exception tree and the named limits (the ground floor);
- ``wire/``: frames, the header schema, every message, socket options, the named-field batch layout;
- ``security/``: tokens, CURVE, admission;
- ``serve/`` (the server framework), ``connect/`` (the client side), ``order/`` (the sample order);
- ``jobs/`` (the job schema and states), ``config`` (the one settings object);
- ``loader/``: ``RemoteLoader`` and what it stands on (imports torch); beside it ``jobapi/``: the
  ``Job`` a training function submitted as a job is handed (docs/jobs.md).

A script needs only this package's face::

    from libbus import RemoteLoader, as_float, merge_cursors, errors

``RemoteLoader`` and the other torch-based names are imported on first use (PEP 562), so
``import libbus`` stays light for services that never load data (the router imports no torch);
their types are declared in ``__init__.pyi``.
libbus imports zmq, never ``services`` or ``cli``.
"""

from __future__ import annotations

import importlib
from typing import Any

from libbus import errors
from libbus.constants import PROTOCOL, VERSION

#: Public name -> the module that defines it (imported when the name is first used).
_LAZY = {
    "RemoteLoader": "libbus.loader.remote",
    "merge_cursors": "libbus.order.elastic",
    "as_float": "libbus.loader.tensors",
    "RankInfo": "libbus.loader.ranks",
    "detect_rank": "libbus.loader.ranks",
    "StallMeter": "libbus.loader.stall",
    "Job": "libbus.jobapi.job",
    "JobEnded": "libbus.jobapi.job",
}

__all__ = [
    "PROTOCOL",
    "VERSION",
    "RankInfo",
    "RemoteLoader",
    "StallMeter",
    "Job",
    "JobEnded",
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
