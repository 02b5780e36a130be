"""The connections of one loader: its dataset's replicas, found, connected, failed over and taken back.

:class:`ReplicaSet` is the I/O half of :class:`~libbus.loader.remote.RemoteLoader` (the other half, which
batch goes where and in what order, is :class:`~libbus.loader.window.RequestWindow`). It resolves the
dataset through the router (or a resolver), connects every replica that serves the same data
(same-host ones over their ``ipc://`` socket and a shared-memory ring), and when one fails it
reconnects it (``retries`` strikes in a row at most), takes it down (its requests go elsewhere),
quarantines the ring slots a frozen provider may still write, and finds providers again — a
restarted one on a new port — until ``provider_wait_s`` runs out (:class:`PeerTimeout`).

A provider on another host is reached over ``flows`` connections (:mod:`libbus.loader.flows`), each a
:class:`~libbus.loader.replica.Replica` of its own that fails over like any replica; a flow dropped
while its provider still answers on the others is opened again (at the next pass, or
:data:`~libbus.loader.flows.FLOW_RETRY_S` later in the middle of one).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq

from libbus.connect.client import Client, Identity
from libbus.constants import HELLO_TIMEOUT_S, PROVIDER_RETRY_S
from libbus.errors import BadRequest, BusError, PeerTimeout, ShmError
from libbus.loader.deliveries import RingDelivery, SocketDelivery, ring_layout
from libbus.loader.delivery_protocol import Delivery
from libbus.loader.flows import FLOW_RETRY_S, auto_flows
from libbus.loader.replica import Replica, entries_of, label_of
from libbus.loader.window_size import WindowSizer, most_for
from libbus.security.curve import curve_key_of
from libbus.wire.dataset_info import ProviderEntry
from libbus.wire.messages import DatasetInfoRequest, Resolve
from libbus.wire.msg_data import info_mismatch
from shm import Ring

__all__ = ["Links", "ReplicaSet"]

# The loader's logger: a script that turns up (or silences) "libbus.loader.remote" sees failovers too.
log = logging.getLogger("libbus.loader.remote")


@dataclass
class Links:
    """How a loader reaches its providers (what :class:`ReplicaSet` is built from)."""

    dataset: str
    split: str
    identity: Identity
    batch_size: int
    device: torch.device
    timeout_s: float
    retries: int
    provider_wait_s: float
    router: str | None = None
    router_key: bytes | None = None
    resolver: Callable[[float], list[dict]] | None = None
    ctx: zmq.Context | None = None
    shm: bool = True
    slots: int = 6
    #: Whether ``slots`` was given (``shm_slots``): a growing window then keeps within it.
    fixed_slots: bool = False
    copy: bool = False
    #: How variable-size fields are yielded: "pad" or "list" (:mod:`libbus.loader.collate`).
    collate: str = "pad"
    #: Connections to each provider on another host; 0: from the batch size (:func:`~libbus.loader.flows.auto_flows`).
    flows: int = 0


def _close_all(owned: list) -> None:
    for item in owned:
        item.close()


class ReplicaSet:
    """The replicas a loader reads from (see the module docstring).

    Raises what the first provider answered (or :class:`PeerTimeout`) when none of ``entries``
    (or, with none, the router's answer) can be reached; :class:`BadRequest` when one serves other
    data or lacks the split.
    """

    def __init__(self, links: Links, entries: list[ProviderEntry] | None, inflight: int, grow: bool = False):
        self.links = links
        self.inflight = min(inflight, links.slots - 1)
        self.inflight_wanted = inflight
        #: Whether the window may grow (``inflight=None``): it does for a dataset read over the network.
        self.grow = grow
        #: What sizes the window of a grown one (:mod:`libbus.loader.window_size`); ``None``: fixed.
        self.sizer: WindowSizer | None = None
        self.socket = SocketDelivery(links.device, links.collate)
        self.ring: RingDelivery | None = None
        # A script that never calls close() still removes its ring when the loader is collected or
        # the interpreter exits (a SIGKILL leaves it to `busctl shm gc`).
        self._owned: list = []
        self._finalizer = weakref.finalize(self, _close_all, self._owned)
        self.replicas: list[Replica] = []
        self.info: dict = {}
        #: Connections to each provider on another host (one to a same-host provider).
        self.flows = 1
        self._next_top_up = 0.0  # a dropped flow is opened again mid-pass no sooner than this
        try:
            self.entries = entries if entries is not None else self.resolve(links.timeout_s, links.retries)
            if not self.entries:
                raise BadRequest("RemoteLoader got an empty provider list; give at least one endpoint")
            self._connect_first()
        except BaseException:
            self.close()
            raise

    @property
    def where(self) -> str:
        return f"{self.links.dataset}/{self.links.split}"

    @property
    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.up]

    @property
    def transport(self) -> str:
        return "shm" if any(r.up and r.delivery is self.ring for r in self.replicas) else "socket"

    def deliveries(self) -> list[Delivery]:
        return [self.socket] if self.ring is None else [self.socket, self.ring]

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()
        self._finalizer()

    # -- finding and connecting -----------------------------------------------------------------
    def _connect_first(self) -> None:
        """Connect every replica that answers (same-host first); fail only when none does."""
        failed: list[BusError] = []
        for entry in self._by_preference(self.entries):
            try:
                self.replicas.append(self._connect(entry, self.links.timeout_s, self.links.retries))
            except (PeerTimeout, BadRequest) as err:  # others (auth, not found) mean the same everywhere
                if not self.info and isinstance(err, BadRequest):
                    raise
                log.warning("%s: provider %s left out: %s", self.links.dataset, label_of(entry), err)
                failed.append(err)
        if not self.replicas:
            raise failed[0]
        self.flows = self.links.flows or auto_flows(self.info, self.links.batch_size, self.inflight_wanted)
        self._top_up()

    def _by_preference(self, entries: list[ProviderEntry]) -> list[ProviderEntry]:
        host = self.links.identity.host_id
        return sorted(entries, key=lambda e: e.get("host_id") != host)

    def resolve(self, timeout_s: float, retries: int) -> list[ProviderEntry]:
        """The dataset's live providers, from the router (or the resolver); [] when neither is set."""
        links = self.links
        if links.router is not None:
            with Client(
                links.router,
                links.identity,
                ctx=links.ctx,
                timeout_s=timeout_s,
                retries=retries,
                server_key=links.router_key,
            ) as rc:
                return entries_of(rc.request(Resolve(dataset=links.dataset)).providers)
        if links.resolver is not None:
            return entries_of(links.resolver(timeout_s))
        return []

    def _client(self, endpoint: str, key: bytes | None) -> Client:
        links = self.links
        return Client(
            endpoint, links.identity, ctx=links.ctx, timeout_s=links.timeout_s, retries=links.retries, server_key=key
        )

    def _connect(self, entry: ProviderEntry, timeout_s: float, retries: int) -> Replica:
        """A connection to one provider, checked to serve the same data, with its delivery."""
        key = curve_key_of(entry)
        client = self._client(entry["endpoint"], key)
        dataset = self.links.dataset
        try:
            reply = client.request(DatasetInfoRequest(dataset=dataset), timeout_s=timeout_s, retries=retries)
            if not self.info:
                splits = reply.info["splits"]
                if self.links.split not in splits:
                    raise BadRequest(f"unknown split {self.links.split!r}; {dataset} has {', '.join(splits)}")
                self.info = reply.info
                self._size_window()
            else:
                why = info_mismatch(self.info, reply.info, "in this loader", f"on {entry['name']}")
                if why:
                    raise BadRequest(
                        f"provider {label_of(entry)} serves a different {dataset!r}: "
                        f"{why}; replicas of a dataset must serve the same data"
                    )
            local = reply.host_id == self.links.identity.host_id
            if self.links.shm and local and reply.local_endpoint:
                client = self._go_local(client, reply.local_endpoint, key)
            delivery = self._delivery_for(client, local, reply.host_id)
        except BaseException:
            client.close()
            raise
        replica = Replica(name=entry["name"], endpoint=entry["endpoint"], client=client, delivery=delivery, local=local)
        replica.watch()  # from now on: a loader idle between passes still hears of its death
        return replica

    def _go_local(self, client: Client, endpoint: str, key: bytes | None) -> Client:
        """Same host: talk to the provider over its Unix socket rather than loopback TCP."""
        path = endpoint.removeprefix("ipc://")
        if not os.path.exists(path):  # a provider in another container or mount namespace
            log.info(
                "%s: provider's %s is not visible here; staying on %s", self.links.dataset, endpoint, client.endpoint
            )
            return client
        client.close()
        return self._client(endpoint, key)

    def _delivery_for(self, client: Client, local: bool, provider_host: str) -> Delivery:
        """The loader's ring (made on first use) for a same-host provider that attaches it; else sockets.

        Every same-host replica attaches the same ring: a request names a free slot whichever
        replica it goes to, and a batch sent again to another replica keeps its slot."""
        if not self.links.shm:
            why = "shm is disabled"
        elif not local:
            why = f"provider is on host {provider_host or '?'}, this loader on {self.links.identity.host_id}"
        else:
            try:
                if self.ring is None:
                    self.ring = self._attach_ring(client)
                else:
                    self.ring.reattach(client)
                return self.ring
            except (ShmError, BusError) as err:
                why = str(err)
        log.info("%s: batches over the socket from %s (%s)", self.where, client.endpoint, why)
        return self.socket

    def _attach_ring(self, client: Client) -> RingDelivery:
        links = self.links
        ring = Ring.create(ring_layout(self.info, links.batch_size, links.slots))
        delivery = None
        try:
            delivery = RingDelivery(ring, links.device, links.copy, links.collate)
            client.request(delivery.attach_message())
        except BaseException:
            if delivery is not None:
                delivery.close()  # unpins (CUDA) before it unmaps
            else:
                ring.close()
            raise
        self._owned.append(delivery)
        log.info(
            "%s: batches through shared memory %s (%d slots of %d bytes)",
            self.where,
            ring.name,
            links.slots,
            ring.layout.slot_bytes,
        )
        return delivery

    # -- failures ---------------------------------------------------------------------------------
    def open_sessions(self) -> None:
        """Before a pass: drop replicas whose connection was lost meanwhile (while others are up),
        and say Hello again to those whose session was dropped (after a failure, or a pass left
        early, or a lost connection: it may be back); one that does not answer is down. Then open
        again the flows dropped from providers that still answer."""
        for replica in self.replicas:
            if not replica.up:
                continue
            lost = replica.lost()
            if lost and any(r.up and r is not replica for r in self.replicas):
                self.down(replica, "connection lost")
            elif lost or replica.client.session is None:
                try:
                    self._rehello(replica)
                except PeerTimeout as err:
                    self.down(replica, str(err))
        self._top_up()

    def _rehello(self, replica: Replica) -> None:
        replica.unwatch()
        replica.client.reset()
        replica.client.hello(min(self.links.timeout_s, HELLO_TIMEOUT_S))
        replica.delivery.reattach(replica.client)  # a new session attaches the ring again
        replica.watch()

    def lost(self, replica: Replica) -> list[int]:
        """``replica``'s connection closed: take it down while others are up, else reconnect it
        (perhaps already restarted on the same endpoint). Returns the batches to send again."""
        if any(r.up and r is not replica for r in self.replicas):
            return self.down(replica, "connection lost")
        return self.strike(replica, "connection lost", count=False)

    def timed_out(self, replica: Replica) -> list[int]:
        """``replica`` left a request unanswered past ``timeout_s``: strike it, and quarantine the
        ring slots of its requests (a grown window goes back to its start). Returns the batches to
        send again."""
        if self.sizer is not None:
            self._keep(self.sizer.timed_out(time.monotonic()))
        ring = replica.delivery if replica.delivery is self.ring else None
        batches = self.strike(replica, f"no reply within {self.links.timeout_s:.1f} s")
        if ring is not None:
            self.quarantine(ring, batches)
        return batches

    def strike(self, replica: Replica, reason: str, count: bool = True) -> list[int]:
        """``replica`` failed its requests: reconnect it, or after ``retries`` strikes in a row
        (or a failed reconnect) take it down. Returns the batches to send again."""
        replica.strikes += count
        if replica.strikes > self.links.retries:
            return self.down(replica, f"{reason}, {replica.strikes} times in a row")
        batches = replica.take_pending()
        log.warning(
            "%s: %s from %s%s; reconnecting, %d request(s) to send again",
            self.where,
            reason,
            replica.client.endpoint,
            f" (flow {replica.flow + 1})" if self.flows > 1 and not replica.local else "",
            len(batches),
        )
        try:
            self._rehello(replica)
        except PeerTimeout as err:
            return self.down(replica, f"{reason}; reconnecting failed: {err}", moving=batches)
        return batches

    # -- the window ------------------------------------------------------------------------------
    def _size_window(self) -> None:
        """With the first provider's DatasetInfo: a window left to the loader grows for a dataset read
        over the network, with ring slots for the largest it may grow to (unless ``shm_slots`` was given)."""
        if not (self.grow and self.info.get("remote")):
            return
        try:
            slot_bytes = ring_layout(self.info, self.links.batch_size, 1).slot_bytes
        except ShmError:  # no ring can hold its batches: they go over the socket
            slot_bytes = 0
        most = most_for(slot_bytes, self.inflight_wanted)
        if not self.links.fixed_slots:
            self.links.slots = max(self.links.slots, most + 2)
        self.sizer = WindowSizer(self.inflight_wanted, most, self.links.timeout_s)

    def arrived(self, round_trip_s: float) -> None:
        """A batch arrived, ``round_trip_s`` after it was asked for: a grown window takes the size its
        sizer says (:mod:`libbus.loader.window_size`)."""
        if self.sizer is not None:
            self._keep(self.sizer.arrived(time.monotonic(), round_trip_s))

    def held(self, seconds: float) -> None:
        """The loop kept the pass thread waiting ``seconds``: not the link's time."""
        if self.sizer is not None:
            self.sizer.held(seconds)

    def _keep(self, window: int) -> None:
        """Keep ``window`` batches in flight, fewer while ring slots are quarantined."""
        self.inflight_wanted = window
        ring = self.ring
        usable = ring.usable if ring is not None and ring.usable >= 2 else window + 1
        self.inflight = min(window, usable - 1, self.links.slots - 1)

    def quarantine(self, ring: RingDelivery, batches: list[int]) -> None:
        """A same-host provider left ``batches`` unanswered: their slots go out of use (it may be
        frozen mid-write). Fewer slots mean fewer requests in flight; with fewer than two left,
        same-host replicas send their batches over the socket from now on."""
        ring.quarantine(batches)
        if ring.usable >= 2:
            self.inflight = min(self.inflight, ring.usable - 1)
            return
        log.warning(
            "%s: %d of %d ring slots may still be written by providers that stopped answering; "
            "same-host batches go over the socket from now on",
            self.where,
            len(ring.quarantined),
            ring.ring.layout.slots,
        )
        self.inflight = self.inflight_wanted
        for replica in self.replicas:
            if replica.delivery is ring:
                replica.delivery = self.socket

    def down(self, replica: Replica, reason: str, moving: list[int] | tuple = ()) -> list[int]:
        """Stop sending to ``replica``; returns its outstanding batches (and ``moving``), to send
        elsewhere."""
        replica.up = False
        batches = [*moving, *replica.take_pending()]
        replica.unwatch()
        replica.client.reset()
        # a flow whose provider still answers on the others is opened again, but not at once: when
        # the provider itself died, its other flows are found lost meanwhile, and none is opened
        self._next_top_up = time.monotonic() + FLOW_RETRY_S
        left = [r.connection for r in self.replicas if r.up]
        log.warning(
            "%s: provider %s dropped: %s; %d request(s) go to %s",
            self.where,
            replica.connection,
            reason,
            len(batches),
            ", ".join(left) or f"a provider that comes back within {self.links.provider_wait_s:g} s",
        )
        return batches

    def _admit(self, replica: Replica) -> None:
        """Read from ``replica`` (and its other flows) from now on; forget the replicas that are down."""
        for gone in [r for r in self.replicas if not r.up]:
            gone.close()
        self.replicas = [r for r in self.replicas if r.up] + [replica]
        self._top_up()

    # -- flows ------------------------------------------------------------------------------------
    def _short(self) -> dict[str, list[Replica]]:
        """The providers on another host that answer on fewer than ``flows`` connections: endpoint ->
        their live flows."""
        live: dict[str, list[Replica]] = {}
        for r in self.replicas:
            if r.up and not r.local and r.delivery is self.socket:
                live.setdefault(r.endpoint, []).append(r)
        return {endpoint: flows for endpoint, flows in live.items() if len(flows) < self.flows}

    def top_up(self) -> None:
        """In the middle of a pass: open again the flows dropped while their provider kept answering
        on the others, at most every :data:`~libbus.loader.flows.FLOW_RETRY_S` (each try may wait
        ``min(timeout_s, 5 s)`` for an answer)."""
        if self.flows > 1 and time.monotonic() >= self._next_top_up:
            self._top_up()

    def _top_up(self) -> None:
        """Open the missing flows of every provider that answers on some: each a connection of its
        own that says Hello and checks the provider still serves the same data. One that fails is
        tried again later; the loader reads on from the flows it has."""
        short = self._short()
        if not short:
            return
        self._next_top_up = time.monotonic() + FLOW_RETRY_S
        quick = min(self.links.timeout_s, HELLO_TIMEOUT_S)
        for flows in short.values():
            first = flows[0]
            have = {r.flow for r in flows}
            for number in (n for n in range(self.flows) if n not in have):
                try:
                    flow = self._open_flow(first, number, quick)
                except BusError as err:
                    log.info("%s: flow %d to %s not opened now: %s", self.where, number + 1, first.label, err)
                    break
                # the dropped connection this one replaces is forgotten
                for old in [r for r in self.replicas if not r.up and r.endpoint == first.endpoint and r.flow == number]:
                    old.close()
                    self.replicas.remove(old)
                self.replicas.append(flow)
            else:
                log.info("%s: %d flows to %s", self.where, self.flows, first.label)

    def _open_flow(self, first: Replica, number: int, timeout_s: float) -> Replica:
        """One more connection to ``first``'s provider, with the same identity (its own session)."""
        client = self._client(first.client.endpoint, first.client.server_key)
        try:
            reply = client.request(DatasetInfoRequest(dataset=self.links.dataset), timeout_s=timeout_s, retries=0)
            why = info_mismatch(self.info, reply.info, "in this loader", f"on {first.name}")
            if why:
                raise BadRequest(f"provider {first.label} now serves a different {self.links.dataset!r}: {why}")
        except BaseException:
            client.close()
            raise
        flow = Replica(
            name=first.name, endpoint=first.endpoint, client=client, delivery=self.socket, local=False, flow=number
        )
        flow.watch()
        return flow

    def readmit(self) -> None:
        """Before a pass, while a replica is down: ask the router (or resolver) for the dataset's
        providers and take back those not in use — a provider restarted on a new port, or one
        registered since. Each try waits ``min(timeout_s, 5 s)`` at most."""
        if all(r.up for r in self.replicas) or (self.links.router is None and self.links.resolver is None):
            return
        quick = min(self.links.timeout_s, HELLO_TIMEOUT_S)
        try:
            entries = self.resolve(quick, 0)
        except BusError as err:  # the router is away: read on from the replicas left
            log.info("%s: cannot ask the router for replicas: %s", self.where, err)
            return
        in_use = {r.endpoint for r in self.replicas if r.up}
        for entry in self._by_preference(entries):
            if entry["endpoint"] in in_use:
                continue
            try:
                replica = self._connect(entry, quick, 0)
            except BusError as err:
                log.info("%s: provider %s not taken back: %s", self.where, label_of(entry), err)
                continue
            self._admit(replica)
            log.warning("%s: provider %s is back; reading from it too", self.where, replica.label)

    def await_replica(self, stopped: Callable[[], bool] | None = None) -> None:
        """No replica is left: look for one (asking the router again, when there is one) until
        ``provider_wait_s`` runs out, then raise :class:`PeerTimeout`; return early, with none,
        once ``stopped()`` says the pass waiting for one was closed."""
        links = self.links
        deadline = time.monotonic() + links.provider_wait_s
        last = "none answered"
        while stopped is None or not stopped():
            left = deadline - time.monotonic()
            try:
                self.entries = self.resolve(max(0.1, min(links.timeout_s, left)), 0) or self.entries
            except BusError as err:  # the router is away too, or lists no provider yet
                last = f"router: {err}"
            for entry in self._by_preference(self.entries):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    replica = self._connect(entry, max(0.1, min(links.timeout_s, left)), 0)
                except BusError as err:
                    last = f"{label_of(entry)}: {err}"
                    continue
                self._admit(replica)
                log.warning("%s: provider %s answers; reading on", self.where, replica.label)
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerTimeout(
                    f"no provider of {self.where} answered for "
                    f"{links.provider_wait_s:g} s (provider_wait_s); last: {last}"
                )
            pause = min(PROVIDER_RETRY_S, left)
            while pause > 0 and (stopped is None or not stopped()):  # in short steps: a closed pass ends it
                time.sleep(min(pause, 0.1))
                pause -= 0.1
