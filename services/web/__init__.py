"""``busctl web``: a read-only view of jobs, studies and services in a browser (docs/web.md)."""

from .logins import *  # noqa: F403
from .logins import __all__ as _logins
from .server import *  # noqa: F403
from .server import __all__ as _server

__all__ = [*_logins, *_server]
