"""The ``Delivery`` protocol: how a loader's request window drives a transport of batch replies.

:class:`~libbus.loader.window.RequestWindow` (ordering, retries, replica choice) never touches bytes: for
each request it sends it asks the delivery for the request's extra ``fields`` (a ring slot and its
sequence number), it passes each reply to ``receive``, and it calls ``hand_out`` when the batch is
made ready for the consumer and ``done`` when the consumer comes back for the next one. Two transports implement it —
:class:`~libbus.loader.deliveries.SocketDelivery` (the batch's bytes are the reply's frames) and
:class:`~libbus.loader.deliveries.RingDelivery` (the provider wrote the batch into a shared-memory slot) —
and mypy checks both against this declaration (the assignments at the end of this module), so a
third transport, or a change to one of them, cannot drift from what the window relies on.

The batch a delivery hands out is typed loosely (``Any``): an ``(x, y)`` tuple of tensors today,
a dict of named fields for datasets that have more than two.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

__all__ = ["Delivery"]


@runtime_checkable
class Delivery(Protocol):
    """What a loader needs from a transport of batch replies (see the module docstring)."""

    #: ``"socket"`` or ``"shm"``: how the batches come (shown in logs and progress reports).
    transport: str

    @property
    def hand_out_in_consumer(self) -> bool:
        """Whether :meth:`hand_out` must run on the thread that uses the batch (a CUDA copy orders
        that thread's current stream after it); else the pass's own thread hands batches out ahead."""
        ...

    def can_send(self) -> bool:
        """Whether a new request can be sent now (a ring needs a free slot)."""
        ...

    def can_take(self, batch_no: int) -> bool:
        """Whether ``batch_no`` can be (re)sent now: it holds a slot already, or one is free."""
        ...

    def fields(self, batch_no: int) -> dict[str, int]:
        """The request fields this transport adds when ``batch_no`` is (re)sent."""
        ...

    def receive(self, batch_no: int, reply: Any) -> Any:
        """What the reply to ``batch_no`` becomes until it is handed out; raises
        :class:`~libbus.errors.BusError` for a malformed reply."""
        ...

    def hand_out(self, batch_no: int, item: Any) -> Any:
        """The batch object yielded for ``batch_no`` (``item`` is what :meth:`receive` made)."""
        ...

    def done(self, batch_no: int) -> None:
        """The consumer asked for the next batch: what ``batch_no`` still held is let go."""
        ...

    def wait_free(self) -> None:
        """Block (boundedly) until a slot held by an asynchronous copy frees up."""
        ...

    def reattach(self, client: Any) -> None:
        """A new session on ``client`` (after a reconnect): set the transport up again."""
        ...

    def reset(self) -> None:
        """A pass ended early: everything held for its requests is free; late replies are refused."""
        ...

    def close(self) -> None:
        """Release the transport's resources (a ring is unlinked)."""
        ...


if TYPE_CHECKING:  # mypy checks both transports against the protocol; nothing runs here
    from libbus.loader.deliveries import RingDelivery, SocketDelivery

    _socket: type[Delivery] = SocketDelivery
    _ring: type[Delivery] = RingDelivery
