"""libbus: the batchbus wire — frames and messages, errors, auth, sockets, sessions, config.

libbus imports zmq, never ``services`` or ``cli``. The remote loader lives in
:mod:`libbus.loader` (it imports torch, so it is not imported here).
"""

#: The wire tag, ``BB`` + the wire version. 2: batches carry named fields (issue 15).
PROTOCOL = b"BB2"
VERSION = "0.1.0"

__all__ = ["PROTOCOL", "VERSION"]
