"""The sample order: which indices make each batch of each epoch, from (seed, epoch, cursor), and
cursors merged across a change of world size.

This face re-exports every submodule's ``__all__``; inside libbus, import the submodule itself."""

from __future__ import annotations

from libbus.order import elastic as _elastic
from libbus.order import epochs as _epochs
from libbus.order import history as _history
from libbus.order.elastic import *  # noqa: F403
from libbus.order.epochs import *  # noqa: F403
from libbus.order.history import *  # noqa: F403

__all__ = [*_elastic.__all__, *_epochs.__all__, *_history.__all__]
