"""The request window of one pass: which batch goes to which replica, and in what order they come out.

A pass over an epoch is a list of batches (sample indices). :class:`RequestWindow` keeps up to
``inflight`` of them requested ahead of the one being yielded, sends each to the replica
:func:`~libbus.loader.replica.pick` chooses (fewest outstanding, same host first, one whose delivery can
take it), keeps the replies that arrive out of order until their turn, and puts the batches of a
failed replica back in line to be sent again. It owns no socket: a replica is anything with
``up``, ``local``, ``pending``, ``delivery`` (a :class:`~libbus.loader.delivery_protocol.Delivery`),
``send(batch_no, message)`` and ``answered(request_id)``, so the window is tested with in-memory
replicas; :class:`~libbus.loader.remote.RemoteLoader` drives it with real connections.

What a reply (or its absence) means is an explicit :data:`Outcome` (:meth:`RequestWindow.classify`),
which the loader acts on: a batch arrived, a late reply to be dropped, a lost connection, a timeout,
an expired session, a provider going away, an error to raise, no replica left, nothing in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from libbus.errors import AuthRequired, Unavailable
from libbus.loader.delivery_protocol import Delivery
from libbus.loader.replica import pick
from libbus.wire.messages import Error

__all__ = [
    "Arrived",
    "ConnectionLost",
    "Failed",
    "GoingAway",
    "Late",
    "NoReplica",
    "NothingPending",
    "Outcome",
    "RequestWindow",
    "SessionExpired",
    "TimedOut",
]


@dataclass(frozen=True)
class Arrived:
    """The reply to ``batch_no`` came from ``replica``: hand it to the batch's delivery."""

    batch_no: int
    reply: Any
    replica: Any


@dataclass(frozen=True)
class Late:
    """A reply to a request already sent again elsewhere (or forgotten): dropped."""


@dataclass(frozen=True)
class ConnectionLost:
    """``replica``'s provider closed the connection."""

    replica: Any


@dataclass(frozen=True)
class TimedOut:
    """No reply came within the timeout; ``overdue`` are the replicas whose oldest request is late."""

    overdue: tuple = ()


@dataclass(frozen=True)
class SessionExpired:
    """``replica`` forgot our session (``AUTH_REQUIRED``) while serving ``batch_no``: say Hello again
    and resend (once per batch: a second time is an error)."""

    replica: Any
    batch_no: int


@dataclass(frozen=True)
class GoingAway:
    """``replica``'s provider is shutting down (``UNAVAILABLE``): its batches go elsewhere."""

    replica: Any
    batch_no: int
    reason: str


@dataclass(frozen=True)
class Failed:
    """``replica`` answered ``batch_no`` with an error to raise (its typed :class:`BusError`)."""

    replica: Any
    batch_no: int
    reply: Any


@dataclass(frozen=True)
class NoReplica:
    """No replica is up: wait for one to come back (or give up)."""


@dataclass(frozen=True)
class NothingPending:
    """Nothing is in flight, and nothing could be sent: wait for a delivery to free a slot."""


Outcome = Arrived | Late | ConnectionLost | TimedOut | SessionExpired | GoingAway | Failed | NoReplica | NothingPending


@dataclass
class RequestWindow:
    """The requests of one pass over ``count`` batches, yielded in batch order.

    Args:
        count: batches in the pass (numbered ``0..count-1``).
        request: ``(batch_no, fields) -> message``: the request for a batch, with the delivery's
            ``fields`` (a ring slot) added.
    """

    count: int
    request: Callable[[int, dict], Any]
    #: batch number -> what its delivery made of the reply, until its turn comes
    ready: dict[int, Any] = field(default_factory=dict)
    #: batch number -> (replica, delivery) it was last sent with
    via: dict[int, tuple[Any, Delivery]] = field(default_factory=dict)
    #: batches to send again (their replica failed), in order
    again: list[int] = field(default_factory=list)
    #: batches resent after a provider forgot our session (once each)
    reauthed: set[int] = field(default_factory=set)
    next_send: int = 0
    #: the next batch to hand out (taken by :meth:`take`)
    next_take: int = 0
    #: the first batch the consumer still holds or is yet to get (let go below it by :meth:`advance`)
    next_yield: int = 0

    @property
    def finished(self) -> bool:
        """Every batch of the pass was handed out."""
        return self.next_yield >= self.count

    def fill(self, replicas: Sequence[Any], inflight: int) -> None:
        """Send the batches waiting to go again, then new ones while fewer than ``inflight`` are
        ahead of the next to yield, as long as some replica can take them."""
        while self.again and self._send(replicas, self.again[0]):
            self.again.pop(0)
        while (
            not self.again
            and self.next_send < self.count
            and self.next_send - self.next_yield < inflight
            and self._send(replicas, self.next_send)
        ):
            self.next_send += 1

    def _send(self, replicas: Sequence[Any], batch_no: int) -> bool:
        replica = pick(list(replicas), batch_no)
        if replica is None:
            return False
        before = self.via.get(batch_no)
        if before is not None and before[1] is not replica.delivery:
            before[1].done(batch_no)  # off the ring: its slot is free again
        self.via[batch_no] = (replica, replica.delivery)
        replica.send(batch_no, self.request(batch_no, replica.delivery.fields(batch_no)))
        return True

    def resend(self, batch_nos: Sequence[int]) -> None:
        """Put ``batch_nos`` back in line, before any new batch (in batch order)."""
        self.again.extend(batch_nos)
        self.again.sort()

    def arrived(self, batch_no: int, reply: Any) -> None:
        """The reply to ``batch_no``: its delivery turns it into the batch to hand out later.
        Raises :class:`~libbus.errors.BusError` for a malformed reply."""
        self.ready[batch_no] = self.via[batch_no][1].receive(batch_no, reply)

    def take(self) -> tuple[int, Delivery, Any] | None:
        """The next batch in order, if its reply is here: ``(batch_no, delivery, item)``, to hand
        out with ``delivery.hand_out(batch_no, item)``; call :meth:`advance` with that delivery once
        the consumer lets it go. ``None`` while it is still in flight."""
        batch_no = self.next_take
        if batch_no not in self.ready:
            return None
        delivery = self.via.pop(batch_no)[1]
        self.next_take += 1
        return batch_no, delivery, self.ready.pop(batch_no)

    def advance(self, delivery: Delivery) -> None:
        """The consumer came back for the batch after ``next_yield``: that one is let go."""
        delivery.done(self.next_yield)
        self.next_yield += 1

    def classify(self, replica: Any, reply: Any, overdue: Sequence[Any] = ()) -> Outcome:
        """What ``(replica, reply)`` from a wait for replies means:

        - ``(replica, None)``: :class:`ConnectionLost`;
        - ``(None, None)``: :class:`TimedOut` (``overdue``: the replicas past their timeout);
        - a reply to a request no longer pending: :class:`Late`;
        - ``AUTH_REQUIRED`` the first time for a batch: :class:`SessionExpired`;
        - ``UNAVAILABLE``: :class:`GoingAway`; any other ``Error``: :class:`Failed`;
        - else :class:`Arrived`.
        """
        if replica is None:
            return TimedOut(tuple(overdue))
        if reply is None:
            return ConnectionLost(replica)
        batch_no = replica.answered(reply.id)
        if batch_no is None:
            return Late()
        if isinstance(reply, Error):
            if reply.code == AuthRequired.code and batch_no not in self.reauthed:
                self.reauthed.add(batch_no)
                return SessionExpired(replica, batch_no)
            if reply.code == Unavailable.code:
                return GoingAway(replica, batch_no, str(reply.message))
            return Failed(replica, batch_no, reply)
        return Arrived(batch_no, reply, replica)
