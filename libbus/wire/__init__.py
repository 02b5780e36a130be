"""The wire: frames and their protocol tag, the header schema, every message type (session, data, jobs),
socket options, the named-field batch layout both ends share, and text bounded by its encoded bytes.

This face re-exports every submodule's ``__all__`` (:mod:`libbus.wire.messages`, the messages' own face,
is the families' and the frames' together); inside libbus, import the submodule itself."""

from __future__ import annotations

from libbus.wire import dataset_info as _dataset_info
from libbus.wire import fields as _fields
from libbus.wire import frames as _frames
from libbus.wire import msg_data as _msg_data
from libbus.wire import msg_jobs as _msg_jobs
from libbus.wire import msg_session as _msg_session
from libbus.wire import schema as _schema
from libbus.wire import sockets as _sockets
from libbus.wire import text as _text
from libbus.wire.dataset_info import *  # noqa: F403
from libbus.wire.fields import *  # noqa: F403
from libbus.wire.frames import *  # noqa: F403
from libbus.wire.msg_data import *  # noqa: F403
from libbus.wire.msg_jobs import *  # noqa: F403
from libbus.wire.msg_session import *  # noqa: F403
from libbus.wire.schema import *  # noqa: F403
from libbus.wire.sockets import *  # noqa: F403
from libbus.wire.text import *  # noqa: F403

__all__ = [
    *_dataset_info.__all__,
    *_fields.__all__,
    *_frames.__all__,
    *_msg_data.__all__,
    *_msg_jobs.__all__,
    *_msg_session.__all__,
    *_schema.__all__,
    *_sockets.__all__,
    *_text.__all__,
]
