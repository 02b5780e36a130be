"""The server framework every service runs on: the poll loop, sessions, the handler base, reply
backlogs, wake-ups and the metrics endpoint. Handlers hold the logic; this folder holds the I/O.

This face re-exports every submodule's ``__all__``; inside libbus, import the submodule itself."""

from __future__ import annotations

from libbus.serve import backlog as _backlog
from libbus.serve import handler as _handler
from libbus.serve import metrics as _metrics
from libbus.serve import server as _server
from libbus.serve import sessions as _sessions
from libbus.serve import wakeup as _wakeup
from libbus.serve.backlog import *  # noqa: F403
from libbus.serve.handler import *  # noqa: F403
from libbus.serve.metrics import *  # noqa: F403
from libbus.serve.server import *  # noqa: F403
from libbus.serve.sessions import *  # noqa: F403
from libbus.serve.wakeup import *  # noqa: F403

__all__ = [
    *_backlog.__all__,
    *_handler.__all__,
    *_metrics.__all__,
    *_server.__all__,
    *_sessions.__all__,
    *_wakeup.__all__,
]
