"""Types of the public names :mod:`libbus` imports on first use (see ``__init__.py``)."""

from libbus import errors as errors
from libbus.constants import PROTOCOL as PROTOCOL
from libbus.constants import VERSION as VERSION
from libbus.jobapi.job import Job as Job
from libbus.jobapi.job import JobEnded as JobEnded
from libbus.loader.ranks import RankInfo as RankInfo
from libbus.loader.ranks import detect as detect_rank
from libbus.loader.remote import RemoteLoader as RemoteLoader
from libbus.loader.stall import StallMeter as StallMeter
from libbus.loader.tensors import as_float as as_float
from libbus.order.elastic import merge_cursors as merge_cursors

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
