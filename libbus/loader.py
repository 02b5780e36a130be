"""``RemoteLoader``: iterate ``(x, y)`` torch tensors of a remote dataset, like a DataLoader.

Batches are pulled by sample index straight from a provider's data socket, with a configurable
number of requests in flight. When the provider runs on this host, batches come through a
shared-memory ring instead (no batch bytes cross the socket; see :mod:`libbus.delivery`). The order is a seeded shuffle that differs per epoch and is
reproducible. A lost reply is resent on a fresh connection; a provider that stays silent raises
:class:`~libbus.errors.PeerTimeout` after ``retries`` resends, never hangs.

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
from .constants import REQUEST_RETRIES, REQUEST_TIMEOUT_S
from .curve import CurveKeys, curve_key_of
from .delivery import RingDelivery, SocketDelivery, ring_layout
from .errors import AuthRequired, BadRequest, BusError, PeerTimeout, ShmError
from .messages import BatchRequest, DatasetInfoRequest, Error, Resolve
from .order import DEFAULT_BLOCK_SIZE, Order, Shuffle

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


class RemoteLoader:
    """Batches of one split of a remote dataset, as ``(x, y)`` tensors on ``device``.

    Args:
        dataset: the name a provider serves it under (``remote://NAME`` also accepted).
        split: ``train`` or ``val`` (``test`` never leaves its provider).
        router: router address to resolve the dataset; or give ``provider`` (its data endpoint).
        token: a trainer (or admin) token, or a callable returning a fresh one.
        batch_size, drop_last: as in ``torch.utils.data.DataLoader``.
        shuffle, seed: ``none``, ``full`` (or ``True``: a permutation per epoch) or ``block``
            (shuffled blocks of ``block_size`` samples, sequential inside), drawn from ``(seed, epoch)``.
        rank, world_size: read shard ``rank`` of ``world_size`` disjoint shards that together
            cover the split; ``drop_uneven`` gives every rank the same count (for DDP).
        inflight: batch requests kept outstanding (prefetch depth).
        timeout_s, retries: per-request reply timeout, and resends before :class:`PeerTimeout`.
        device: where yielded tensors live (``"cpu"``, ``"cuda:0"``...).
        shm: use a shared-memory ring when the provider is on this host (falls back to the
            socket, with a log line saying why, when it is not possible).
        shm_slots: ring slots (default ``inflight + 1``; 2 is a double buffer).
        copy: on CPU with a ring, yield copies. By default tensors view the ring slot and are
            valid until the next batch is asked for.
        host_id: this machine's id (default: /etc/machine-id), compared with the provider's.
        curve: this client's CURVE key pair (:func:`libbus.curve.load_keys`) on a CURVE cluster;
            its name must be the token's subject. ``router_key`` is then the router's public key,
            and ``provider_key`` the provider's when ``provider=`` is given (with ``router=``,
            the router's ``Resolved`` reply carries it).
    """

    def __init__(self, dataset: str, *, token: str | Callable[[], str], split: str = "train",
                 router: str | None = None, provider: str | None = None, batch_size: int = 64,
                 shuffle: bool | str = True, seed: int = 0, drop_last: bool = False, rank: int = 0,
                 world_size: int = 1, block_size: int = DEFAULT_BLOCK_SIZE, drop_uneven: bool = False,
                 inflight: int = 4, timeout_s: float = REQUEST_TIMEOUT_S,
                 retries: int = REQUEST_RETRIES, name: str | None = None, device: str = "cpu",
                 shm: bool = True, shm_slots: int = 0, copy: bool = False, host_id: str | None = None,
                 ctx: zmq.Context | None = None, curve: CurveKeys | None = None,
                 router_key: bytes | None = None, provider_key: bytes | None = None):
        if (router is None) == (provider is None):
            raise BadRequest("RemoteLoader needs exactly one of router= or provider=")
        if batch_size < 1 or inflight < 1:
            raise BadRequest("batch_size and inflight must be at least 1")
        slots = shm_slots or inflight + 1
        if slots < 2:
            raise BadRequest(f"shm_slots must be at least 2 (one in use, one in flight), got {slots}")
        self.dataset = dataset.removeprefix("remote://")
        self.split = split
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.rank, self.world_size = rank, world_size
        self.inflight = inflight
        self.timeout_s, self.retries = timeout_s, retries
        self.epoch = 0
        #: Seconds spent waiting for batches (not hidden by prefetch), summed over iterations.
        self.wait_s = 0.0
        self.device = torch.device(device)
        role = _role_of(token() if callable(token) else token)
        identity = Identity(role=role, name=name or f"loader-{socket.gethostname()}-{os.getpid()}",
                            token=token, host_id=host_id or machine_id(), curve=curve, router_key=router_key)
        self._ctx = ctx
        self.provider = provider
        if router is not None:
            with Client(router, identity, ctx=ctx, timeout_s=timeout_s, retries=retries,
                        server_key=router_key) as rc:
                resolved = rc.request(Resolve(dataset=self.dataset))
            picked = pick_provider(resolved.providers, identity.host_id)
            self.provider = picked["endpoint"]
            provider_key = curve_key_of(picked)
        self._server_key = provider_key
        self.client = Client(self.provider, identity, ctx=ctx, timeout_s=timeout_s, retries=retries,
                             server_key=provider_key)
        #: The endpoint requests go to: ``provider``, or its ``ipc://`` twin on the same host.
        self.endpoint = self.provider
        reply = self.client.request(DatasetInfoRequest(dataset=self.dataset))
        self.info: dict = reply.info
        splits = self.info["splits"]
        if split not in splits:
            self.client.close()
            raise BadRequest(f"unknown split {split!r}; {self.dataset} has {', '.join(splits)}")
        self.num_samples = int(splits[split]["num_samples"])
        try:
            self._order = Order(n=self.num_samples, seed=seed, shuffle=Shuffle.parse(shuffle),
                                block_size=block_size, rank=rank, world_size=world_size,
                                batch_size=batch_size, drop_last=drop_last, drop_uneven=drop_uneven)
        except BusError:
            self.client.close()
            raise
        #: Samples of the current epoch already handed out: with ``epoch``, the loader's cursor.
        self.position = 0
        self.inflight = min(inflight, slots - 1)
        if shm and reply.host_id == identity.host_id and reply.local_endpoint:
            self._go_local(reply.local_endpoint, identity)
        self._delivery = self._open_delivery(shm, reply.host_id, identity.host_id, slots, copy)
        # A script that never calls close() still removes its ring when the loader is collected or
        # the interpreter exits (a SIGKILL leaves it to `busctl shm gc`).
        self._finalizer = weakref.finalize(self, self._delivery.close)

    @property
    def transport(self) -> str:
        """``"shm"`` when batches come through a shared-memory ring, else ``"socket"``."""
        return self._delivery.transport

    def _go_local(self, endpoint: str, identity: Identity) -> None:
        """Same host: talk to the provider over its Unix socket rather than loopback TCP."""
        path = endpoint.removeprefix("ipc://")
        if not os.path.exists(path):  # a provider in another container or mount namespace
            log.info("%s: provider's %s is not visible here; staying on %s", self.dataset, endpoint,
                     self.provider)
            return
        self.client.close()
        self.client = Client(endpoint, identity, ctx=self._ctx, timeout_s=self.timeout_s, retries=self.retries,
                             server_key=self._server_key)
        self.endpoint = endpoint

    def _open_delivery(self, shm: bool, provider_host: str, local_host: str, slots: int,
                       copy: bool) -> SocketDelivery | RingDelivery:
        """A ring when provider and loader share a host and the provider attaches it; else sockets."""
        if not shm:
            why = "shm is disabled"
        elif provider_host != local_host:
            why = f"provider is on host {provider_host or '?'}, this loader on {local_host}"
        else:
            try:
                return self._attach_ring(slots, copy)
            except (ShmError, BusError) as err:
                why = str(err)
        log.info("%s/%s: batches over the socket from %s (%s)", self.dataset, self.split, self.endpoint, why)
        return SocketDelivery(self.device)

    def _attach_ring(self, slots: int, copy: bool) -> RingDelivery:
        ring = Ring.create(ring_layout(self.info, self.batch_size, slots))
        delivery = None
        try:
            delivery = RingDelivery(ring, self.device, copy)
            self.client.request(delivery.attach_message())
        except BaseException:
            if delivery is not None:
                delivery.close()  # unpins (CUDA) before it unmaps
            else:
                ring.close()
            raise
        log.info("%s/%s: batches through shared memory %s (%d slots of %d bytes)", self.dataset,
                 self.split, ring.name, slots, ring.layout.slot_bytes)
        return delivery

    def close(self) -> None:
        self._finalizer()
        self.client.close()

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
        if len(indices) and indices[-1] - indices[0] == len(indices) - 1 and (
                len(indices) == 1 or bool(np.all(np.diff(indices) == 1))):
            return BatchRequest(dataset=self.dataset, split=self.split,
                                range=[int(indices[0]), int(indices[-1]) + 1], **fields)
        return BatchRequest(dataset=self.dataset, split=self.split,
                            frames=[np.ascontiguousarray(indices, dtype="<i8").data], **fields)

    def _fetch(self, batches: list[np.ndarray], epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        delivery = self._delivery
        try:
            yield from self._pipeline(batches, delivery, epoch)
        finally:
            delivery.reset()  # a pass left early: its slots are free again, late replies refused

    def _pipeline(self, batches: list[np.ndarray], delivery,
                  epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        client = self.client
        if client.session is None:
            client.hello(self.timeout_s)
            delivery.reattach(client)
        pending: dict[int, int] = {}       # request id -> batch number
        sent_at: dict[int, float] = {}     # batch number -> when last sent
        attempts: dict[int, int] = {}      # batch number -> resends so far
        ready: dict[int, object] = {}      # batch number -> what delivery.receive made of it
        next_send = next_yield = 0

        def send(batch_no: int) -> None:
            # the epoch seeds a pipeline dataset's random stages: a resend gets the same bytes
            rid = client.send(self._request(batches[batch_no], {"epoch": epoch, **delivery.fields(batch_no)}))
            pending[rid] = batch_no
            sent_at[batch_no] = time.monotonic()

        def resend_all(reason: str) -> None:
            log.warning("%s/%s: %s; reconnecting to %s and resending %d request(s)", self.dataset,
                        self.split, reason, self.endpoint, len(pending))
            outstanding = sorted(pending.values())
            pending.clear()
            client.reset()
            try:
                client.hello(self.timeout_s)
                delivery.reattach(client)
            except PeerTimeout:
                pass  # counted against the batches' attempts below
            for batch_no in outstanding:
                send(batch_no)

        while next_yield < len(batches):
            while (next_send < len(batches) and next_send - next_yield < self.inflight
                   and delivery.can_send()):
                send(next_send)
                next_send += 1
            if next_yield in ready:
                yield delivery.hand_out(next_yield, ready.pop(next_yield))
                delivery.done(next_yield)  # the consumer is back: the batch it had is let go
                next_yield += 1
                continue
            if not pending:
                delivery.wait_free()  # slots held by copies to the GPU still running
                continue
            oldest = min(sent_at[b] for b in pending.values())
            wait_start = time.monotonic()
            reply = client.recv(max(0.0, oldest + self.timeout_s - wait_start))
            self.wait_s += time.monotonic() - wait_start
            if reply is None:
                late = min(pending.values())
                attempts[late] = attempts.get(late, 0) + 1
                if attempts[late] > self.retries:
                    client.reset()
                    raise PeerTimeout(f"provider {self.endpoint} did not answer batch {late} of "
                                      f"{self.dataset}/{self.split} within {self.timeout_s:.1f} s "
                                      f"after {self.retries} retries")
                resend_all(f"no reply within {self.timeout_s:.1f} s")
                continue
            batch_no = pending.pop(reply.id, None)
            if batch_no is None:
                continue  # a late reply to a request we already resent
            if isinstance(reply, Error):
                if reply.code == AuthRequired.code and attempts.get(batch_no, 0) < 1:
                    attempts[batch_no] = 1
                    pending[reply.id] = batch_no
                    resend_all("session expired on the provider")
                    continue
                client.check(reply)
            ready[batch_no] = delivery.receive(batch_no, reply)
