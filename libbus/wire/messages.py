"""Every message on the batchbus wire, defined once: its type name, header fields, payload frames and,
for a request, its reply.

This is the public face: import messages, :func:`encode`, :func:`decode` and the frame helpers from
here. The definitions live in one place each: the wire format (the :class:`Message` base, the
:func:`message` decorator and the type registry, :class:`Request`, encode/decode, frame helpers) in
:mod:`libbus.wire.frames`; the message classes by family in :mod:`libbus.wire.msg_session` (session,
errors, stats and peers, security), :mod:`libbus.wire.msg_data` (datasets, batches, shared memory,
evaluation, pipeline control, sample locations) and
:mod:`libbus.wire.msg_jobs` (jobs, commands to trainers, studies). Importing this module imports every
family, which registers every message type in :data:`MESSAGE_TYPES`; the exports are assembled from the
families' own ``__all__`` (as pyzmq's are), so no message name is written here.

A message is ``[b"BB2", header, *payload]``: ``header`` is an orjson object with ``type`` and the
message's fields; bulk data (indices, samples, labels, weights) travels only in ``payload`` frames.
"""

from __future__ import annotations

from libbus.wire import frames as _frames
from libbus.wire import msg_data as _msg_data
from libbus.wire import msg_jobs as _msg_jobs
from libbus.wire import msg_session as _msg_session
from libbus.wire.frames import *  # noqa: F403
from libbus.wire.msg_data import *  # noqa: F403
from libbus.wire.msg_jobs import *  # noqa: F403
from libbus.wire.msg_session import *  # noqa: F403

__all__ = [*_frames.__all__, *_msg_session.__all__, *_msg_data.__all__, *_msg_jobs.__all__]
