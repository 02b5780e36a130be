"""The client side of a connection: a request-reply :class:`Client` and the services' reconnecting
router link.

This face re-exports every submodule's ``__all__``; inside libbus, import the submodule itself."""

from __future__ import annotations

from libbus.connect import client as _client
from libbus.connect import link as _link
from libbus.connect.client import *  # noqa: F403
from libbus.connect.link import *  # noqa: F403

__all__ = [*_client.__all__, *_link.__all__]
