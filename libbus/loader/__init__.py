"""The training script's side: :class:`RemoteLoader`, its request window, replicas and failover,
the shm or socket delivery, flows per provider, collation, ranks, the stall meter and DataLoader's habits. Imports torch.

This face re-exports every submodule's ``__all__``; inside libbus, import the submodule itself."""

from __future__ import annotations

from libbus.loader import collate as _collate
from libbus.loader import context as _context
from libbus.loader import dataloader as _dataloader
from libbus.loader import deliveries as _deliveries
from libbus.loader import delivery_protocol as _delivery_protocol
from libbus.loader import flows as _flows
from libbus.loader import ranks as _ranks
from libbus.loader import remote as _remote
from libbus.loader import replica as _replica
from libbus.loader import replica_set as _replica_set
from libbus.loader import stall as _stall
from libbus.loader import tensors as _tensors
from libbus.loader import window as _window
from libbus.loader.collate import *  # noqa: F403
from libbus.loader.context import *  # noqa: F403
from libbus.loader.dataloader import *  # noqa: F403
from libbus.loader.deliveries import *  # noqa: F403
from libbus.loader.delivery_protocol import *  # noqa: F403
from libbus.loader.flows import *  # noqa: F403
from libbus.loader.ranks import *  # noqa: F403
from libbus.loader.remote import *  # noqa: F403
from libbus.loader.replica import *  # noqa: F403
from libbus.loader.replica_set import *  # noqa: F403
from libbus.loader.stall import *  # noqa: F403
from libbus.loader.tensors import *  # noqa: F403
from libbus.loader.window import *  # noqa: F403

__all__ = [
    *_collate.__all__,
    *_context.__all__,
    *_dataloader.__all__,
    *_deliveries.__all__,
    *_delivery_protocol.__all__,
    *_flows.__all__,
    *_ranks.__all__,
    *_remote.__all__,
    *_replica_set.__all__,
    *_replica.__all__,
    *_stall.__all__,
    *_tensors.__all__,
    *_window.__all__,
]
