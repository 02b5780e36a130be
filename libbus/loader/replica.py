"""Replicas: several providers serving one dataset, and how a loader spreads requests over them.

Replicas of a dataset must serve the same data: the router refuses a provider whose DatasetInfo
for a name disagrees with the live replicas (:func:`info_mismatch` names the field), and a loader
refuses a replica whose info differs from the one its sample order was built on.

A loader talks to each replica through one :class:`Replica` (a connection and the delivery its
batches come through) and sends each request to the live replica with the fewest requests
outstanding (:func:`pick`), a same-host replica first when they tie: its batches come through
shared memory rather than over the network. A provider on another host may be reached over several
connections (flows, :mod:`libbus.loader.flows`): each is a :class:`Replica` of its own, numbered by
``flow``, so requests spread over flows as over replicas.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Required, TypedDict

import zmq

from libbus.connect.client import Client
from libbus.wire.dataset_info import ProviderEntry
from libbus.wire.messages import Message
from libbus.wire.sockets import drain_monitor

__all__ = [
    "GivenProvider",
    "Replica",
    "ReplyPoller",
    "entries_of",
    "entry_of",
    "label_of",
    "pick",
    "recv_any",
]


class GivenProvider(TypedDict, total=False):
    """A provider as a loader is given it (``RemoteLoader(provider=...)``) or the router's ``Resolve`` answers
    it (:class:`~libbus.wire.dataset_info.ProviderEntry`): its endpoint, and what else is known of it."""

    endpoint: Required[str]
    name: str
    host_id: str
    curve_key: str


def entry_of(provider: str | GivenProvider) -> ProviderEntry:
    """A provider as a ``Resolved`` entry ``{name, endpoint, host_id, curve_key}``."""
    if isinstance(provider, str):
        return {"name": provider, "endpoint": provider, "host_id": "", "curve_key": ""}
    return {"name": provider.get("name") or provider["endpoint"], "host_id": "", "curve_key": "", **provider}


def entries_of(providers: list) -> list[ProviderEntry]:
    """Providers as ``Resolved`` entries, one per endpoint: a provider listed twice (a reconnected
    one whose old session a router has not yet let go, or a list given twice) is one replica, not
    two connections that would fight over one ring. The later listing wins (the newer session), in
    the first one's place."""
    by_endpoint: dict[str, ProviderEntry] = {}
    for entry in map(entry_of, providers):
        by_endpoint[entry["endpoint"]] = entry
    return list(by_endpoint.values())


def label_of(entry: Mapping[str, Any]) -> str:
    """How logs and errors name a provider: ``name (endpoint)``, or the endpoint alone."""
    name, endpoint = entry.get("name") or "", entry.get("endpoint") or ""
    return endpoint if name in ("", endpoint) else f"{name} ({endpoint})"


@dataclass(eq=False)
class Replica:
    """One provider of a loader's dataset: its connection, and the delivery its batches use.

    ``endpoint`` is what the provider advertises (how replicas are told apart); ``client`` may
    talk to its same-host ``ipc://`` twin instead.
    """

    name: str
    endpoint: str
    client: Client
    delivery: Any
    local: bool = False
    #: Which connection to its provider this is (0 = the first; more with ``flows``).
    flow: int = 0
    #: request id -> batch number, for requests sent on the current connection.
    pending: dict[int, int] = field(default_factory=dict)
    #: batch number -> when it was last sent here.
    sent_at: dict[int, float] = field(default_factory=dict)
    #: Timeouts since the last reply; more than the loader's ``retries`` takes the replica down.
    strikes: int = 0
    #: Seconds from sending the request last answered to reading its reply (the stall split's ``T``).
    round_trip_s: float = 0.0
    #: Replies to batch requests that came through this connection.
    received: int = 0
    up: bool = True
    #: Monitor of the connection's socket: a provider that dies closes its end, and the loader
    #: hears of it at once rather than after a request times out.
    monitor: zmq.Socket | None = None
    _watched: zmq.Socket | None = None

    @property
    def label(self) -> str:
        """The provider's name (every flow of a provider has the same)."""
        return label_of({"name": self.name, "endpoint": self.endpoint})

    @property
    def connection(self) -> str:
        """How logs name this connection: the provider, and which flow when it has several."""
        return self.label if self.flow == 0 else f"{self.label} flow {self.flow + 1}"

    def oldest(self) -> float:
        """When the longest-waiting request here was sent (``inf`` when none waits)."""
        return min((self.sent_at[b] for b in self.pending.values()), default=float("inf"))

    def take_pending(self) -> list[int]:
        """Forget this connection's requests and return their batch numbers, to send again."""
        batches = sorted(self.pending.values())
        self.pending.clear()
        self.sent_at.clear()
        return batches

    def answered(self, request_id: int) -> int | None:
        """The batch a reply answers (``None`` for a late reply to a request sent again)."""
        batch_no = self.pending.pop(request_id, None)
        if batch_no is not None:
            sent = self.sent_at.pop(batch_no, None)
            self.round_trip_s = time.monotonic() - sent if sent is not None else 0.0
            self.strikes = 0
            self.received += 1
        return batch_no

    def send(self, batch_no: int, msg: Message) -> None:
        rid = self.client.send(msg)
        self.pending[rid] = batch_no
        self.sent_at[batch_no] = time.monotonic()
        self.watch()

    def watch(self) -> None:
        """Monitor the client's current socket for disconnection (a reset client has a new one)."""
        sock = self.client.socket
        if sock is self._watched:
            return
        self.unwatch()
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._watched = sock

    def unwatch(self) -> None:
        if self.monitor is None:
            return
        try:
            if self._watched is not None:
                self._watched.disable_monitor()
        except zmq.ZMQError:
            pass  # the socket is closed already: its monitor stopped with it
        self.monitor.close(0)
        self.monitor = self._watched = None

    def lost(self) -> bool:
        """Whether the connection was dropped (the provider's end closed) since the last call."""
        return drain_monitor(self.monitor, zmq.EVENT_DISCONNECTED)

    def close(self) -> None:
        self.unwatch()
        self.client.close()


def pick(replicas: list[Replica], batch_no: int) -> Replica | None:
    """The live replica to send ``batch_no`` to: fewest outstanding, same-host first on ties,
    among those whose delivery can take it (a ring needs a free slot); ``None`` when none can."""
    best = None
    for r in replicas:
        if not r.up or not r.delivery.can_take(batch_no):
            continue
        if best is None or (len(r.pending), not r.local) < (len(best.pending), not best.local):
            best = r
    return best


class ReplyPoller:
    """A zmq.Poller over the replicas' sockets, rebuilt only when the set of sockets changes."""

    def __init__(self) -> None:
        self.key: tuple = ()
        self.poller = zmq.Poller()

    def poll(self, sockets: list[zmq.Socket], timeout_ms: int) -> set[zmq.Socket]:
        """The sockets among ``sockets`` with something to read, waiting up to ``timeout_ms``."""
        key = tuple(id(s) for s in sockets)
        if key != self.key:
            self.key, self.poller = key, zmq.Poller()
            for s in sockets:
                self.poller.register(s, zmq.POLLIN)
        return {sock for sock, _ in self.poller.poll(timeout_ms)}


def recv_any(
    replicas: list[Replica], timeout_s: float, poller: ReplyPoller | None = None
) -> tuple[Replica | None, Message | None]:
    """The next reply from any of ``replicas`` with requests pending: ``(replica, reply)``;
    ``(replica, None)`` when its connection was lost; ``(None, None)`` once ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    poller = poller or ReplyPoller()
    waiting = [r for r in replicas if r.pending]
    while True:
        for r in waiting:  # usually a reply is waiting already: take it without a poll
            msg = r.client.recv(0)
            if msg is not None:
                return r, msg
        left = deadline - time.monotonic()
        if left <= 0 or not waiting:
            return None, None
        sockets = [r.client.socket for r in waiting] + [r.monitor for r in waiting if r.monitor is not None]
        readable = poller.poll(sockets, math.ceil(left * 1000))
        for r in waiting:  # a monitor event (queued now or before): is it the connection lost?
            if r.monitor in readable and r.lost():
                return r, None
