"""Same-host delivery through POSIX shared-memory rings (docs/protocol.md §4.3).

Segment (a mapped ``/dev/shm`` file) → Ring (slots and their protocol) → typed numpy views; names
and owners in :mod:`shm.names`, clean-up in :mod:`shm.gc`, CUDA pinning in :mod:`shm.cuda` (which
imports torch lazily). This package imports neither zmq nor torch.
"""

from .gc import SegmentInfo, collect_garbage, list_segments
from .names import SHM_DIR, new_name, parse_name
from .ring import Ring, RingLayout, SlotState
from .segment import Segment

__all__ = [
    "SHM_DIR",
    "Ring",
    "RingLayout",
    "Segment",
    "SegmentInfo",
    "SlotState",
    "collect_garbage",
    "list_segments",
    "new_name",
    "parse_name",
]
