"""``RemoteLoader``: iterate ``(x, y)`` torch tensors of a remote dataset, like a DataLoader.

Batches are pulled by sample index straight from the providers' data sockets, with a configurable
number of requests in flight. When several providers serve the dataset (replicas), each request
goes to the one with the fewest outstanding (see :mod:`libbus.replicas`). When a provider runs on
this host, its batches come through a shared-memory ring instead (no batch bytes cross the
socket; see :mod:`libbus.delivery`). The order is a seeded shuffle that differs per epoch and is
reproducible, and batches are yielded in that order whichever replica served them.

Failures cost a retry, never a sample: a provider whose connection drops is dropped at once and its
requests go to another replica; a request a provider leaves unanswered is resent on a fresh
connection, and a provider that stays silent (``retries`` times in a row) is dropped too. With none
left, the loader waits up to ``provider_wait_s`` for one to come back — asking the router again,
when it has one, so a provider restarted on a new port is found — and then raises
:class:`~libbus.errors.PeerTimeout`. It never hangs.

    loader = RemoteLoader("mnist", router="tcp://head:5555", token=token, batch_size=64)
    for epoch in range(3):
        for x, y in loader:      # each pass is the next epoch
            ...
"""

from __future__ import annotations

import logging
import os
import socket
import time
import weakref
from collections.abc import Callable, Iterator

import jwt
import numpy as np
import torch
import zmq

from shm import Ring

from .client import Client, Identity
from .config import host_id as machine_id
from .constants import (
    HELLO_TIMEOUT_S,
    PROVIDER_RETRY_S,
    PROVIDER_WAIT_S,
    REQUEST_RETRIES,
    REQUEST_TIMEOUT_S,
)
from .curve import CurveKeys, curve_key_of
from .delivery import RingDelivery, SocketDelivery, ring_layout
from .errors import (
    AuthRequired,
    BadRequest,
    BusError,
    PeerTimeout,
    ShmError,
    Unavailable,
)
from .messages import BatchRequest, DatasetInfoRequest, Error, Message, Resolve
from .order import DEFAULT_BLOCK_SIZE, Order, Shuffle
from .replicas import (
    Replica,
    ReplyPoller,
    entry_of,
    info_mismatch,
    label_of,
    pick,
    recv_any,
)

__all__ = ["RemoteLoader", "pick_provider"]

log = logging.getLogger(__name__)


def _role_of(token: str) -> str:
    """The role a token claims (read unverified: the server verifies it)."""
    try:
        return str(jwt.decode(token, options={"verify_signature": False}).get("role", "trainer"))
    except jwt.InvalidTokenError:
        return "trainer"


def pick_provider(providers: list[dict], local_host: str) -> dict:
    """Prefer a provider on this host (its batches need not cross the network), else the first."""
    for p in providers:
        if p.get("host_id") == local_host:
            return p
    return providers[0]


def _close_all(owned: list) -> None:
    for item in owned:
        item.close()


class RemoteLoader:
    """Batches of one split of a remote dataset, as ``(x, y)`` tensors on ``device``.

    Args:
        dataset: the name a provider serves it under (``remote://NAME`` also accepted).
        split: ``train`` or ``val`` (``test`` never leaves its provider).
        router: router address to resolve the dataset (to every live replica, and again when
            none answers). Or give ``provider``: one data endpoint, or a list of replicas as
            endpoints or ``Resolved`` entries (``{name, endpoint, host_id, curve_key}``).
        resolver: with ``provider``, a callable ``(timeout_s) -> [Resolved entry]`` that asks the
            router for the dataset's providers within ``timeout_s`` (raising a :class:`BusError`
            otherwise), used when replicas fail; a service with its own router link passes one.
        token: a trainer (or admin) token, or a callable returning a fresh one.
        batch_size, drop_last: as in ``torch.utils.data.DataLoader``.
        shuffle, seed: ``none``, ``full`` (or ``True``: a permutation per epoch) or ``block``
            (shuffled blocks of ``block_size`` samples, sequential inside), drawn from ``(seed, epoch)``.
        rank, world_size: read shard ``rank`` of ``world_size`` disjoint shards that together
            cover the split; ``drop_uneven`` gives every rank the same count (for DDP).
        inflight: batch requests kept outstanding (prefetch depth), over all replicas.
        timeout_s, retries: per-request reply timeout, and how many times in a row a replica may
            leave a request unanswered (each time it is reconnected and asked again) before its
            requests go to another replica.
        provider_wait_s: with no replica left, how long to wait for one to come back before
            :class:`PeerTimeout`.
        device: where yielded tensors live (``"cpu"``, ``"cuda:0"``...).
        shm: use a shared-memory ring for providers on this host (falls back to the socket,
            with a log line saying why, when it is not possible).
        shm_slots: ring slots (default ``inflight + 2``: every request in flight, the batch being
            handed out and the one the loop still holds; 2 is a double buffer).
        copy: on CPU with a ring, always yield copies. By default tensors view the ring slot, which
            returns to the ring only when the last tensor viewing it is freed: a batch stays valid
            for as long as it is held, as with ``DataLoader``; a batch that would take the last slot
            the pipeline needs is copied instead.
        collate: how variable-size fields of a multi-field dataset are yielded: ``"pad"`` (one
            tensor padded to the batch's longest, plus ``<name>_lengths``) or ``"list"`` (a list
            of tensors); see :mod:`libbus.collate`. Such datasets yield a dict of fields; those of
            exactly two fixed fields ``x``, ``y`` yield ``(x, y)``.
        host_id: this machine's id (default: /etc/machine-id), compared with the provider's.
        curve: this client's CURVE key pair (:func:`libbus.curve.load_keys`) on a CURVE cluster;
            its name must be the token's subject. ``router_key`` is then the router's public key,
            and ``provider_key`` the provider's when ``provider=`` is one endpoint (with
            ``router=``, and in ``Resolved`` entries, each provider's key comes with it).

    Raises :class:`BadRequest` for bad arguments, and what the first provider answered (or
    :class:`PeerTimeout`) when no provider given or resolved can be reached.
    """

    def __init__(
        self,
        dataset: str,
        *,
        token: str | Callable[[], str],
        split: str = "train",
        router: str | None = None,
        provider: str | list | None = None,
        resolver: Callable[[float], list[dict]] | None = None,
        batch_size: int = 64,
        shuffle: bool | str = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        block_size: int = DEFAULT_BLOCK_SIZE,
        drop_uneven: bool = False,
        inflight: int = 4,
        timeout_s: float = REQUEST_TIMEOUT_S,
        retries: int = REQUEST_RETRIES,
        provider_wait_s: float = PROVIDER_WAIT_S,
        name: str | None = None,
        device: str = "cpu",
        shm: bool = True,
        shm_slots: int = 0,
        copy: bool = False,
        collate: str = "pad",
        host_id: str | None = None,
        ctx: zmq.Context | None = None,
        curve: CurveKeys | None = None,
        router_key: bytes | None = None,
        provider_key: bytes | None = None,
    ):
        if (router is None) == (provider is None):
            raise BadRequest("RemoteLoader needs exactly one of router= or provider=")
        if router is not None and resolver is not None:
            raise BadRequest("RemoteLoader resolves through router= itself; resolver= goes with provider=")
        if batch_size < 1 or inflight < 1:
            raise BadRequest("batch_size and inflight must be at least 1")
        if provider_wait_s < 0:
            raise BadRequest(f"provider_wait_s must not be negative, got {provider_wait_s}")
        slots = shm_slots or inflight + 2
        if slots < 2:
            raise BadRequest(f"shm_slots must be at least 2 (one in use, one in flight), got {slots}")
        self.dataset = dataset.removeprefix("remote://")
        self.split = split
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.rank, self.world_size = rank, world_size
        self._block_size, self._drop_uneven = block_size, drop_uneven
        self.inflight = min(inflight, slots - 1)
        self._inflight_wanted = inflight
        self.timeout_s, self.retries = timeout_s, retries
        self.provider_wait_s = provider_wait_s
        self.epoch = 0
        #: Samples of the current epoch already handed out: with ``epoch``, the loader's cursor.
        self.position = 0
        #: Seconds spent waiting for batches (not hidden by prefetch), summed over iterations.
        self.wait_s = 0.0
        self.device = torch.device(device)
        role = _role_of(token() if callable(token) else token)
        self._identity = Identity(
            role=role,
            name=name or f"loader-{socket.gethostname()}-{os.getpid()}",
            token=token,
            host_id=host_id or machine_id(),
            curve=curve,
            router_key=router_key,
        )
        self._ctx = ctx
        self._router, self._router_key, self._resolver = router, router_key, resolver
        self._shm, self._slots, self._copy = shm, slots, copy
        self._socket = SocketDelivery(self.device, collate)
        self._collate = collate
        self._ring: RingDelivery | None = None
        # A script that never calls close() still removes its ring when the loader is collected or
        # the interpreter exits (a SIGKILL leaves it to `busctl shm gc`).
        self._owned: list = []
        self._finalizer = weakref.finalize(self, _close_all, self._owned)
        #: The replicas this loader talks to (those found down are dropped when a new one is found).
        self.replicas: list[Replica] = []
        self.info: dict = {}
        if router is not None:
            self._entries = self._resolve(timeout_s, retries)
        else:
            self._entries = [entry_of(p) for p in (provider if isinstance(provider, list) else [provider])]
            if provider_key and len(self._entries) == 1 and not self._entries[0]["curve_key"]:
                self._entries[0]["curve_key"] = provider_key.decode()
            if not self._entries:
                raise BadRequest("RemoteLoader got an empty provider list; give at least one endpoint")
        try:
            self._connect_first()
        except BaseException:
            self.close()
            raise

    def _connect_first(self) -> None:
        """Connect every replica that answers (same-host first); fail only when none does."""
        failed: list[BusError] = []
        for entry in self._by_preference(self._entries):
            try:
                self.replicas.append(self._connect(entry, self.timeout_s, self.retries))
            except (PeerTimeout, BadRequest) as err:  # others (auth, not found) mean the same everywhere
                if not self.info and isinstance(err, BadRequest):
                    raise
                log.warning("%s: provider %s left out: %s", self.dataset, label_of(entry), err)
                failed.append(err)
        if not self.replicas:
            raise failed[0]

    def _by_preference(self, entries: list[dict]) -> list[dict]:
        host = self._identity.host_id
        return sorted(entries, key=lambda e: e.get("host_id") != host)

    def _resolve(self, timeout_s: float, retries: int) -> list[dict]:
        """The dataset's live providers, from the router (or the resolver); [] when neither is set."""
        if self._router is not None:
            with Client(
                self._router,
                self._identity,
                ctx=self._ctx,
                timeout_s=timeout_s,
                retries=retries,
                server_key=self._router_key,
            ) as rc:
                return [entry_of(p) for p in rc.request(Resolve(dataset=self.dataset)).providers]
        if self._resolver is not None:
            return [entry_of(p) for p in self._resolver(timeout_s)]
        return []

    def _connect(self, entry: dict, timeout_s: float, retries: int) -> Replica:
        """A connection to one provider, checked to serve the same data, with its delivery."""
        key = curve_key_of(entry)
        client = Client(
            entry["endpoint"],
            self._identity,
            ctx=self._ctx,
            timeout_s=self.timeout_s,
            retries=self.retries,
            server_key=key,
        )
        try:
            reply = client.request(DatasetInfoRequest(dataset=self.dataset), timeout_s=timeout_s, retries=retries)
            if not self.info:
                self._take_info(reply.info)
            else:
                why = info_mismatch(self.info, reply.info, "in this loader", f"on {entry['name']}")
                if why:
                    raise BadRequest(
                        f"provider {label_of(entry)} serves a different {self.dataset!r}: "
                        f"{why}; replicas of a dataset must serve the same data"
                    )
            local = reply.host_id == self._identity.host_id
            if self._shm and local and reply.local_endpoint:
                client = self._go_local(client, reply.local_endpoint, key)
            delivery = self._delivery_for(client, local, reply.host_id)
        except BaseException:
            client.close()
            raise
        replica = Replica(name=entry["name"], endpoint=entry["endpoint"], client=client, delivery=delivery, local=local)
        replica.watch()  # from now on: a loader idle between passes still hears of its death
        return replica

    def _take_info(self, info: dict) -> None:
        """The first provider's DatasetInfo: the split's size and the order it yields."""
        splits = info["splits"]
        if self.split not in splits:
            raise BadRequest(f"unknown split {self.split!r}; {self.dataset} has {', '.join(splits)}")
        self.num_samples = int(splits[self.split]["num_samples"])
        self._order = Order(
            n=self.num_samples,
            seed=self.seed,
            shuffle=Shuffle.parse(self.shuffle),
            block_size=self._block_size,
            rank=self.rank,
            world_size=self.world_size,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            drop_uneven=self._drop_uneven,
        )
        self.info = info

    @property
    def provider(self) -> str:
        """The advertised endpoint of the first replica (same-host first)."""
        return self.replicas[0].endpoint if self.replicas else ""

    @property
    def endpoint(self) -> str:
        """Where the first replica's requests go: ``provider``, or its ``ipc://`` twin on this host."""
        return self.replicas[0].client.endpoint if self.replicas else ""

    @property
    def _delivery(self) -> SocketDelivery | RingDelivery:
        return self._ring or self._socket

    @property
    def transport(self) -> str:
        """``"shm"`` when batches come through a shared-memory ring, else ``"socket"``."""
        return "shm" if any(r.up and r.delivery is self._ring for r in self.replicas) else "socket"

    def _go_local(self, client: Client, endpoint: str, key: bytes | None) -> Client:
        """Same host: talk to the provider over its Unix socket rather than loopback TCP."""
        path = endpoint.removeprefix("ipc://")
        if not os.path.exists(path):  # a provider in another container or mount namespace
            log.info("%s: provider's %s is not visible here; staying on %s", self.dataset, endpoint, client.endpoint)
            return client
        client.close()
        return Client(
            endpoint, self._identity, ctx=self._ctx, timeout_s=self.timeout_s, retries=self.retries, server_key=key
        )

    def _delivery_for(self, client: Client, local: bool, provider_host: str) -> SocketDelivery | RingDelivery:
        """The loader's ring (made on first use) for a same-host provider that attaches it; else sockets.

        Every same-host replica attaches the same ring: a request names a free slot whichever
        replica it goes to, and a batch sent again to another replica keeps its slot."""
        if not self._shm:
            why = "shm is disabled"
        elif not local:
            why = f"provider is on host {provider_host or '?'}, this loader on {self._identity.host_id}"
        else:
            try:
                if self._ring is None:
                    self._ring = self._attach_ring(client)
                else:
                    self._ring.reattach(client)
                return self._ring
            except (ShmError, BusError) as err:
                why = str(err)
        log.info("%s/%s: batches over the socket from %s (%s)", self.dataset, self.split, client.endpoint, why)
        return self._socket

    def _attach_ring(self, client: Client) -> RingDelivery:
        ring = Ring.create(ring_layout(self.info, self.batch_size, self._slots))
        delivery = None
        try:
            delivery = RingDelivery(ring, self.device, self._copy, self._collate)
            client.request(delivery.attach_message())
        except BaseException:
            if delivery is not None:
                delivery.close()  # unpins (CUDA) before it unmaps
            else:
                ring.close()
            raise
        self._owned.append(delivery)
        log.info(
            "%s/%s: batches through shared memory %s (%d slots of %d bytes)",
            self.dataset,
            self.split,
            ring.name,
            self._slots,
            ring.layout.slot_bytes,
        )
        return delivery

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()
        self._finalizer()

    def __enter__(self) -> RemoteLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def set_epoch(self, epoch: int) -> None:
        """Read ``epoch``'s order on the next pass, from its start (passes advance it on their own).

        Setting the epoch the loader is already in keeps its position, so a position restored by
        :meth:`load_state_dict` survives a training loop's ``set_epoch`` call.
        """
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def order(self, epoch: int) -> np.ndarray:
        """The sample indices this rank reads in ``epoch``."""
        return self._order.indices(epoch)

    def __len__(self) -> int:
        return self._order.num_batches()

    def state_dict(self) -> dict:
        """The loader's cursor, JSON-ready: store it with a checkpoint to resume at the exact sample."""
        return self._order.state(self.epoch, self.position)

    def load_state_dict(self, state: dict) -> None:
        """Continue at a saved cursor on the next pass. Raises :class:`BadRequest` for a cursor
        saved with another dataset size, seed, shuffle or world size (naming what differs)."""
        self.epoch, self.position = self._order.restore(state)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One pass: the rest of the current epoch. A pass left early is continued by the next."""
        epoch, position = self.epoch, self.position
        batches = self._order.batches(epoch, start=position)
        fetch = self._fetch(batches, epoch)
        try:
            for item, batch in zip(fetch, batches):
                position += len(batch)
                self.position = position  # counted when handed out: a checkpoint now includes it
                yield item
        finally:
            fetch.close()  # frees ring slots now, not whenever the generator is collected
        self.epoch, self.position = epoch + 1, 0

    # -- the pipeline ---------------------------------------------------------------------------
    def _request(self, indices: np.ndarray, fields: dict) -> BatchRequest:
        if (
            len(indices)
            and indices[-1] - indices[0] == len(indices) - 1
            and (len(indices) == 1 or bool(np.all(np.diff(indices) == 1)))
        ):
            return BatchRequest(
                dataset=self.dataset, split=self.split, range=[int(indices[0]), int(indices[-1]) + 1], **fields
            )
        return BatchRequest(
            dataset=self.dataset, split=self.split, frames=[np.ascontiguousarray(indices, dtype="<i8").data], **fields
        )

    def _fetch(self, batches: list[np.ndarray], epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        try:
            yield from self._pipeline(batches, epoch)
        finally:
            # A pass left early: its slots are free again, and late replies are dropped.
            for delivery in {id(self._socket): self._socket, id(self._ring): self._ring}.values():
                if delivery is not None:
                    delivery.reset()
            for replica in self.replicas:
                replica.take_pending()

    def _pipeline(self, batches: list[np.ndarray], epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        ready: dict[int, object] = {}  # batch number -> what its delivery made of the reply
        via: dict[int, tuple[Replica, object]] = {}  # batch number -> replica and delivery last sent with
        again: list[int] = []  # batches to send again (their replica failed), in order
        reauthed: set[int] = set()  # batches resent after the provider forgot our session
        poller = ReplyPoller()
        next_send = next_yield = 0
        self._open_sessions()
        self._readmit()

        def send(batch_no: int) -> bool:
            replica = pick(self.replicas, batch_no)
            if replica is None:
                return False
            before = via.get(batch_no)
            if before is not None and before[1] is not replica.delivery:
                before[1].done(batch_no)  # off the ring: its slot is free again
            via[batch_no] = (replica, replica.delivery)
            # the epoch seeds a pipeline dataset's random stages: a resend gets the same bytes
            replica.send(
                batch_no, self._request(batches[batch_no], {"epoch": epoch, **replica.delivery.fields(batch_no)})
            )
            return True

        def resend(batch_nos: list[int]) -> None:
            again.extend(batch_nos)
            again.sort()

        while next_yield < len(batches):
            while again and send(again[0]):
                again.pop(0)
            while not again and next_send < len(batches) and next_send - next_yield < self.inflight and send(next_send):
                next_send += 1
            if next_yield in ready:
                delivery = via.pop(next_yield)[1]
                yield delivery.hand_out(next_yield, ready.pop(next_yield))
                delivery.done(next_yield)  # the consumer is back: the batch it had is let go
                next_yield += 1
                continue
            wait_start = time.monotonic()
            try:
                batch_no, reply = self._next_reply(resend, reauthed, poller)
            finally:  # waiting for replies and for providers to come back: data wait
                self.wait_s += time.monotonic() - wait_start
            if batch_no is None:
                continue
            ready[batch_no] = via[batch_no][1].receive(batch_no, reply)

    def _next_reply(
        self, resend: Callable[[list[int]], None], reauthed: set[int], poller: ReplyPoller
    ) -> tuple[int | None, Message | None]:
        """Wait for the next reply to a request of this pass: ``(batch number, reply)``,
        or ``(None, None)`` after handling a failure (the batches to send again go to
        ``resend``), an unexpected reply, or finding a provider again when none was left.
        Raises the typed error of an ``Error`` reply, and :class:`PeerTimeout`."""
        live = [r for r in self.replicas if r.up]
        if not live:
            self._await_replica()
            return None, None
        if not any(r.pending for r in live):
            self._delivery.wait_free()  # slots held by copies to the GPU still running
            return None, None
        oldest = min(r.oldest() for r in live)
        replica, reply = recv_any(live, max(0.0, oldest + self.timeout_s - time.monotonic()), poller)
        if replica is not None and reply is None:  # its provider closed the connection: gone
            if any(r.up and r is not replica for r in self.replicas):
                resend(self._down(replica, "connection lost"))
            else:  # the only one: perhaps already restarted on the same endpoint
                resend(self._strike(replica, "connection lost", count=False))
            return None, None
        if replica is None:
            now = time.monotonic()
            for r in live:
                if r.oldest() + self.timeout_s <= now:
                    ring = r.delivery if r.delivery is self._ring else None
                    batches = self._strike(r, f"no reply within {self.timeout_s:.1f} s")
                    if ring is not None:
                        self._quarantine(ring, batches)
                    resend(batches)
            return None, None
        batch_no = replica.answered(reply.id)
        if batch_no is None:
            return None, None  # a late reply to a request already sent again
        if isinstance(reply, Error):
            if reply.code == AuthRequired.code and batch_no not in reauthed:
                reauthed.add(batch_no)
                resend([batch_no, *self._strike(replica, "session expired on the provider", count=False)])
                return None, None
            if reply.code == Unavailable.code:  # the provider is going away
                resend([batch_no, *self._down(replica, reply.message)])
                return None, None
            replica.client.check(reply)
        return batch_no, reply

    # -- failures ---------------------------------------------------------------------------------
    def _open_sessions(self) -> None:
        """Before a pass: drop replicas whose connection was lost meanwhile (while others are up),
        and say Hello again to those whose session was dropped (after a failure, or a pass left
        early, or a lost connection: it may be back); one that does not answer is down."""
        for replica in self.replicas:
            if not replica.up:
                continue
            lost = replica.lost()
            if lost and any(r.up and r is not replica for r in self.replicas):
                self._down(replica, "connection lost")
            elif lost or replica.client.session is None:
                try:
                    self._rehello(replica)
                except PeerTimeout as err:
                    self._down(replica, str(err))

    def _rehello(self, replica: Replica) -> None:
        replica.unwatch()
        replica.client.reset()
        replica.client.hello(min(self.timeout_s, HELLO_TIMEOUT_S))
        replica.delivery.reattach(replica.client)  # a new session attaches the ring again
        replica.watch()

    def _strike(self, replica: Replica, reason: str, count: bool = True) -> list[int]:
        """``replica`` failed its requests: reconnect it, or after ``retries`` strikes in a row
        (or a failed reconnect) take it down. Returns the batches to send again."""
        replica.strikes += count
        if replica.strikes > self.retries:
            return self._down(replica, f"{reason}, {replica.strikes} times in a row")
        batches = replica.take_pending()
        log.warning(
            "%s/%s: %s from %s; reconnecting, %d request(s) to send again",
            self.dataset,
            self.split,
            reason,
            replica.client.endpoint,
            len(batches),
        )
        try:
            self._rehello(replica)
        except PeerTimeout as err:
            return self._down(replica, f"{reason}; reconnecting failed: {err}", moving=batches)
        return batches

    def _quarantine(self, ring: RingDelivery, batches: list[int]) -> None:
        """A same-host provider left ``batches`` unanswered: their slots go out of use (it may be
        frozen mid-write). Fewer slots mean fewer requests in flight; with fewer than two left,
        same-host replicas send their batches over the socket from now on."""
        ring.quarantine(batches)
        if ring.usable >= 2:
            self.inflight = min(self.inflight, ring.usable - 1)
            return
        log.warning(
            "%s/%s: %d of %d ring slots may still be written by providers that stopped answering; "
            "same-host batches go over the socket from now on",
            self.dataset,
            self.split,
            len(ring.quarantined),
            ring.ring.layout.slots,
        )
        self.inflight = self._inflight_wanted
        for replica in self.replicas:
            if replica.delivery is ring:
                replica.delivery = self._socket

    def _down(self, replica: Replica, reason: str, moving: list[int] = ()) -> list[int]:
        """Stop sending to ``replica``; returns its outstanding batches (and ``moving``), to send
        elsewhere."""
        replica.up = False
        batches = [*moving, *replica.take_pending()]
        replica.unwatch()
        replica.client.reset()
        left = [r.label for r in self.replicas if r.up]
        log.warning(
            "%s/%s: provider %s dropped: %s; %d request(s) go to %s",
            self.dataset,
            self.split,
            replica.label,
            reason,
            len(batches),
            ", ".join(left) or f"a provider that comes back within {self.provider_wait_s:g} s",
        )
        return batches

    def _admit(self, replica: Replica) -> None:
        """Read from ``replica`` from now on; forget the replicas that are down."""
        for gone in [r for r in self.replicas if not r.up]:
            gone.close()
        self.replicas = [r for r in self.replicas if r.up] + [replica]

    def _readmit(self) -> None:
        """Before a pass, while a replica is down: ask the router (or resolver) for the dataset's
        providers and take back those not in use — a provider restarted on a new port, or one
        registered since. Each try waits ``min(timeout_s, 5 s)`` at most."""
        if all(r.up for r in self.replicas) or (self._router is None and self._resolver is None):
            return
        quick = min(self.timeout_s, HELLO_TIMEOUT_S)
        try:
            entries = self._resolve(quick, 0)
        except BusError as err:  # the router is away: read on from the replicas left
            log.info("%s/%s: cannot ask the router for replicas: %s", self.dataset, self.split, err)
            return
        in_use = {r.endpoint for r in self.replicas if r.up}
        for entry in self._by_preference(entries):
            if entry["endpoint"] in in_use:
                continue
            try:
                replica = self._connect(entry, quick, 0)
            except BusError as err:
                log.info("%s/%s: provider %s not taken back: %s", self.dataset, self.split, label_of(entry), err)
                continue
            self._admit(replica)
            log.warning("%s/%s: provider %s is back; reading from it too", self.dataset, self.split, replica.label)

    def _await_replica(self) -> None:
        """No replica is left: look for one (asking the router again, when there is one) until
        ``provider_wait_s`` runs out, then raise :class:`PeerTimeout`."""
        deadline = time.monotonic() + self.provider_wait_s
        last = "none answered"
        while True:
            left = deadline - time.monotonic()
            try:
                self._entries = self._resolve(max(0.1, min(self.timeout_s, left)), 0) or self._entries
            except BusError as err:  # the router is away too, or lists no provider yet
                last = f"router: {err}"
            for entry in self._by_preference(self._entries):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    replica = self._connect(entry, max(0.1, min(self.timeout_s, left)), 0)
                except BusError as err:
                    last = f"{label_of(entry)}: {err}"
                    continue
                self._admit(replica)
                log.warning("%s/%s: provider %s answers; reading on", self.dataset, self.split, replica.label)
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerTimeout(
                    f"no provider of {self.dataset}/{self.split} answered for "
                    f"{self.provider_wait_s:g} s (provider_wait_s); last: {last}"
                )
            time.sleep(min(PROVIDER_RETRY_S, left))
