"""Flows: how many connections a loader opens to each provider on another host.

Cloud networks cap one TCP connection at 5–10 Gbit/s (25 with ENA Express), while a node of 8 GPUs
training on decoded 224² images needs about 20 Gbit/s: one connection per provider cannot feed it.
A loader may therefore spread its requests to one provider over ``flows`` connections. Each flow
is one :class:`~libbus.loader.replica.Replica` of its own — its own DEALER socket and TCP connection,
the same identity and token, its own session — so the request window spreads batches over flows as
it does over replicas (fewest outstanding first), yields them in batch order, and a flow that fails
is reconnected or dropped, and its requests sent again on the others, by the same failover code.

A provider on this host keeps one flow: its batches come through the shared-memory ring (or its
``ipc://`` socket), which no per-connection cap limits.

The default (``flows=0`` or ``None``) comes from the bytes of one batch (:func:`auto_flows`): one
flow below :data:`FLOW_BATCH_BYTES`, two from there. A batch below 4 MiB spends under 7 ms on the
wire even at 5 Gbit/s, so the loader waits on the provider's read and decode, not on the connection;
more flows would only thin the requests in flight on each and add a session each. From 4 MiB a batch
(32 decoded 224² RGB images are 4.6 MiB) the reading is bandwidth-bound, and two flows carry twice
what one capped connection does. Never more flows than requests in flight: a flow with none idles.
"""

from __future__ import annotations

from libbus.errors import BadRequest
from libbus.wire.fields import fields_of_info

__all__ = ["FLOW_BATCH_BYTES", "FLOW_RETRY_S", "MAX_FLOWS", "auto_flows", "batch_bytes", "check_flows"]

#: From this many bytes a batch, the default is two flows per provider on another host.
FLOW_BATCH_BYTES = 4 * 1024 * 1024
#: At most this many flows per provider (each is a session on the provider, of ``sessions_per_subject``).
MAX_FLOWS = 16
#: While a provider has fewer flows than asked (one was dropped), how often, at most, the loader
#: opens the missing ones again in the middle of a pass (at the start of every pass it always tries).
FLOW_RETRY_S = 10.0


def batch_bytes(info: dict, batch_size: int) -> int:
    """Bytes of one full batch of the dataset ``info`` describes (a variable field counts its declared
    maximum, or nothing when it declares none)."""
    return batch_size * sum(f.sample_nbytes for f in fields_of_info(info))


def auto_flows(info: dict, batch_size: int, inflight: int) -> int:
    """The default flows per remote provider: 1 for batches under :data:`FLOW_BATCH_BYTES`, else 2;
    never more than ``inflight``."""
    wanted = 1 if batch_bytes(info, batch_size) < FLOW_BATCH_BYTES else 2
    return max(1, min(wanted, inflight))


def check_flows(flows: int | None, inflight: int) -> int:
    """``flows`` as given to a loader: ``0`` for the default (``None`` too), else 1..:data:`MAX_FLOWS`
    and at most ``inflight``. Raises :class:`BadRequest` naming the bound."""
    if flows is None:
        return 0
    if isinstance(flows, bool) or not isinstance(flows, int) or flows < 0:
        raise BadRequest(f"flows must be a whole number of connections per provider (0: default), got {flows!r}")
    if flows > MAX_FLOWS:
        raise BadRequest(f"flows={flows}: at most {MAX_FLOWS} connections per provider")
    if flows > inflight:
        raise BadRequest(
            f"flows={flows} needs inflight of at least {flows} (each flow carries requests of its own); "
            f"inflight is {inflight}: raise inflight, or ask for fewer flows"
        )
    return flows
