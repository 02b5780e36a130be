"""Types of the public names :mod:`libbus` imports on first use (see ``__init__.py``)."""

from . import errors as errors
from .elastic import merge_cursors as merge_cursors
from .loader import RemoteLoader as RemoteLoader
from .ranks import RankInfo as RankInfo
from .ranks import detect as detect_rank
from .stall import StallMeter as StallMeter
from .tensors import as_float as as_float

PROTOCOL: bytes
VERSION: str

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
