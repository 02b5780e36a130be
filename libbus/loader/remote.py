"""``RemoteLoader``: iterate ``(x, y)`` torch tensors of a remote dataset, like a DataLoader.

Batches are pulled by sample index straight from the providers' data sockets, ``inflight`` requests
at a time, each to the replica with the fewest outstanding (:mod:`libbus.loader.replica`); from a provider
on this host, through a shared-memory ring (:mod:`libbus.loader.deliveries`). The order is a seeded shuffle,
new each epoch and reproducible, and batches are yielded in it whichever replica served them.

The loader is thin: :class:`~libbus.loader.window.RequestWindow` (no sockets) decides which batch is
requested from which replica and yields them in order, :class:`~libbus.loader.replica_set.ReplicaSet` owns
the connections and their failures, :class:`~libbus.loader.pass_pipeline.PassPipeline` waits for replies
and acts on each explicit outcome (:data:`~libbus.loader.window.Outcome`) on the pass's own thread, and
this module keeps the cursor and the order and hands the batches out (:mod:`libbus.loader.handoff`).

Failures cost a retry, never a sample: a provider whose connection drops is dropped at once and its
requests go to another replica; a request a provider leaves unanswered is resent on a fresh
connection, and a provider that stays silent (``retries`` times in a row) is dropped too. With none
left, the loader waits up to ``provider_wait_s`` for one to come back — asking the router again,
when it has one, so a provider restarted on a new port is found — and then raises
:class:`~libbus.errors.PeerTimeout`. It never hangs.

    loader = RemoteLoader("mnist", router="tcp://head:5555", token=token, batch_size=64)
    for epoch in range(loader.epoch, 3):
        loader.set_epoch(epoch)  # optional: each pass is the next epoch anyway
        for x, y in loader:      # a whole epoch, as a DataLoader's pass
            ...

Every ``iter()`` is a whole pass, as with a ``DataLoader``: the next epoch (or the one :meth:`set_epoch`
named), from its start, whether or not the pass before it was left early. Only the first pass after
:meth:`load_state_dict` continues at the loaded cursor (torchdata ``StatefulDataLoader``'s rule).
A pass run to its end leaves its thread asking for the next epoch's first batches, so the window does not
drain at the boundary (:mod:`libbus.loader.batch_stream`); a next pass that is not that epoch from its
start discards them.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Never

import jwt
import numpy as np
import torch
import zmq

from libbus.config import host_id as machine_id
from libbus.config import script_connection
from libbus.connect.client import Identity, pick_provider
from libbus.constants import PROVIDER_WAIT_S, REQUEST_RETRIES, REQUEST_TIMEOUT_S
from libbus.errors import BadRequest, ConfigError, OutOfRange, SplitPrivate
from libbus.loader import window_size
from libbus.loader.batch_stream import BatchStream
from libbus.loader.context import loader_context
from libbus.loader.dataloader import DatasetSplit, pending_state, refuse_dataloader_args, refuse_rebatching
from libbus.loader.deliveries import RingDelivery
from libbus.loader.delivery_protocol import Delivery
from libbus.loader.flows import check_flows
from libbus.loader.handoff import Ended, Handoff, Raised
from libbus.loader.pass_pipeline import PassPipeline, settle_ring_requests
from libbus.loader.ranks import detect
from libbus.loader.readahead import READ_AHEAD
from libbus.loader.replica import Replica, entries_of
from libbus.loader.replica_set import Links, ReplicaSet
from libbus.loader.stall import StallMeter
from libbus.order import elastic
from libbus.order.elastic import Plan
from libbus.order.epochs import (
    DEFAULT_BLOCK_SIZE,
    Order,
    Shuffle,
    batches_of,
    check_skips,
    shard_bounds,
    shift_skips,
)
from libbus.security.curve import CurveKeys, load_keys, load_public_key

__all__ = ["RemoteLoader", "pick_provider"]

log = logging.getLogger(__name__)


def _role_of(token: str) -> str:
    """The role a token claims (read unverified: the server verifies it)."""
    try:
        return str(jwt.decode(token, options={"verify_signature": False}).get("role", "trainer"))
    except jwt.InvalidTokenError:
        return "trainer"


class RemoteLoader(torch.utils.data.IterableDataset):
    """Batches of one split of a remote dataset, as ``(x, y)`` tensors on ``device``.

    Args:
        dataset: the name a provider serves it under (``remote://NAME`` also accepted).
        split: ``train`` or ``val``; ``test`` only where its provider lets it leave (a private
            test split is refused here, with :class:`SplitPrivate`).
        router: router address to resolve the dataset (to every live replica, and again when
            none answers). Or give ``provider``: one data endpoint, or a list of replicas as
            endpoints or ``Resolved`` entries (``{name, endpoint, host_id, curve_key}``). Neither:
            the router ``busctl`` would use (:func:`libbus.config.script_connection`:
            ``BATCHBUS_ROUTER``, the file ``BATCHBUS_CONFIG`` names, else its default).
        resolver: with ``provider``, a callable ``(timeout_s) -> [Resolved entry]`` that asks the
            router for the dataset's providers within ``timeout_s`` (raising a :class:`BusError`
            otherwise), used when replicas fail; a service with its own router link passes one.
        token: a trainer (or admin) token, or a callable returning a fresh one. Not given: the
            token ``busctl`` would use (``BATCHBUS_TOKEN``, ``BATCHBUS_TOKEN_FILE``, the config file).
        batch_size, drop_last: as in ``torch.utils.data.DataLoader``.
        shuffle, seed: ``none``, ``full`` (or ``True``: a permutation per epoch) or ``block``
            (shuffled blocks of ``block_size`` samples, sequential inside), drawn from ``(seed, epoch)``.
            Default: ``True`` for ``train``, ``"none"`` for other splits.
        shard: read only this rank's shard of the split. Default: on for ``train`` (or when
            ``rank``/``world_size`` are given), off for other splits, so that every rank of a
            script evaluates on the whole split; a sharded evaluation sums its totals over ranks.
        rank, world_size: read shard ``rank`` of ``world_size`` disjoint shards that together
            cover the split. Not given: from an initialized ``torch.distributed`` process group,
            else ``RANK``/``WORLD_SIZE`` (:func:`libbus.loader.ranks.detect`), else 0 of 1.
            ``drop_uneven`` gives every rank the same count (default: on for a sharded ``train``
            split with more than one rank; off elsewhere, so a sharded evaluation reads every sample).
        inflight: batch requests kept outstanding (prefetch depth), over all replicas. ``None``: 4, and
            for a dataset its provider reads over the network (a store, ``http(s)://``), grown while
            batches arrive faster for it, up to 12 (fewer for batches over 18 MiB), back to 4 when a
            request times out (:mod:`libbus.loader.window_size`).
        read_ahead: where the provider can use it (a remote store's dataset with a RAM cache), tell it
            the samples of this many batches after those in flight, so that it fetches their blocks
            before they are asked for (:mod:`libbus.loader.readahead`); 0: never.
        flows: connections to each provider on another host, the requests spread over them, each
            reply still yielded in order and exactly once (:mod:`libbus.loader.flows`): a network that
            caps each TCP flow carries several. ``None`` or ``0``: 1 for batches under 4 MiB, else 2
            (never more than ``inflight``). A provider on this host keeps one (the ring or its socket).
        timeout_s, retries: per-request reply timeout, and how many times in a row a replica may
            leave a request unanswered (each time it is reconnected and asked again) before its
            requests go to another replica.
        provider_wait_s: with no replica left, how long to wait for one to come back before
            :class:`PeerTimeout`.
        device: where yielded tensors live (``"cpu"``, ``"cuda:0"``...).
        shm: use a shared-memory ring for providers on this host (falls back to the socket,
            with a log line saying why, when it is not possible).
        shm_slots: ring slots (default ``inflight + 2``: every request in flight, the batch being
            handed out and the one the loop still holds; 2 is a double buffer; for a window that may
            grow, its largest + 2). A window that grows keeps within slots given here.
        copy: on CPU with a ring, always yield copies. By default tensors view the ring slot, which
            returns to the ring only when the last tensor viewing it is freed: a batch stays valid
            for as long as it is held, as with ``DataLoader``; a batch that would take the last slot
            the pipeline needs is copied instead.
        collate: a dataset of named fields yields a dict, its variable-size fields ``"pad"``-ded (plus
            ``<name>_lengths``) or as a ``"list"`` (:mod:`libbus.loader.collate`); one of ``x``, ``y``: ``(x, y)``.
        host_id: this machine's id (default: /etc/machine-id), compared with the provider's.
        ctx: the ZeroMQ context of its sockets. Default: the loaders' own, whose I/O threads never
            preempt the training loop (:func:`libbus.loader.context.loader_context`).
        curve: this client's CURVE key pair (:func:`libbus.security.curve.load_keys`) on a CURVE cluster;
            its name must be the token's subject. ``router_key`` is then the router's public key,
            and ``provider_key`` the provider's when ``provider=`` is one endpoint (with
            ``router=``, and in ``Resolved`` entries, each provider's key comes with it).
        transform: a callable applied to each batch before it is yielded (in this process).
        samples: a record range ``(start, stop)`` (or a ``range``) of the split: the loader reads
            these samples only, and its epochs, order, shards, ``len(loader.dataset)`` and cursors
            are over them (a cursor saved on one range is refused on another).
        stall_breakdown: ask the providers where each batch's time went, and split the time this
            loader waits into queueing, source read, each pipeline stage, transfer
            (``loader.stall.breakdown()``, :mod:`libbus.loader.stall`). Off: the total and the
            slowest replica only.
        skip: samples never to read: a list of skips, each a list of ``[start, stop)`` index ranges of
            the split, oldest first (a job's ``skip``, docs/jobs.md). They leave every epoch's order
            before it is cut into shards; a cursor saved under fewer skips resumes under these, the
            rest of its epoch otherwise unchanged (:mod:`libbus.order.elastic`).

    ``DataLoader`` arguments (``sampler``, ``num_workers``, ``collate_fn``...) are refused with a
    :class:`BadRequest` naming what replaces each (:mod:`libbus.loader.dataloader`).

    Raises :class:`BadRequest` for bad arguments, :class:`SplitPrivate` for a split its provider
    keeps, :class:`ConfigError` for a missing token or bad settings when they are read from the
    environment, and what the first provider answered (or :class:`PeerTimeout`) when no provider
    given or resolved can be reached.
    """

    def __init__(
        self,
        dataset: str,
        *,
        token: str | Callable[[], str] | None = None,
        split: str = "train",
        router: str | None = None,
        provider: str | list | None = None,
        resolver: Callable[[float], list[dict]] | None = None,
        batch_size: int = 64,
        shuffle: bool | str | None = None,
        seed: int = 0,
        drop_last: bool = False,
        shard: bool | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        drop_uneven: bool | None = None,
        inflight: int | None = None,
        read_ahead: int = READ_AHEAD,
        flows: int | None = None,
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
        transform: Callable[[Any], Any] | None = None,
        samples: tuple[int, int] | range | None = None,
        stall_breakdown: bool = True,
        skip: Sequence[Sequence[Sequence[int]]] = (),
        **dataloader_only: Never,
    ):
        refuse_dataloader_args(dataloader_only)
        if router is not None and provider is not None:
            raise BadRequest("RemoteLoader takes one of router= or provider=, not both")
        if token is None or (router is None and provider is None):
            conn = script_connection()  # what busctl would use: BATCHBUS_* and the config file
            if router is None and provider is None:
                router = conn.router
                if curve is None and conn.curve_key_file:
                    curve = load_keys(conn.curve_key_file)
                    router_key = router_key or load_public_key(conn.curve_router_key)
            if token is None:
                if not conn.token:
                    raise ConfigError(
                        "RemoteLoader needs a token: pass token=, or set BATCHBUS_TOKEN_FILE (or "
                        "BATCHBUS_TOKEN, or token_file in the config file BATCHBUS_CONFIG names); "
                        "'busctl token issue --role reader --dataset NAME' makes one"
                    )
                token = conn.token
        if router is not None and resolver is not None:
            raise BadRequest("RemoteLoader resolves through router= itself; resolver= goes with provider=")
        if batch_size < 1 or (inflight is not None and inflight < 1):
            raise BadRequest("batch_size and inflight must be at least 1")
        grow, inflight = inflight is None, window_size.START if inflight is None else inflight
        if read_ahead < 0:
            raise BadRequest(f"read_ahead must be 0 (off) or more batches, got {read_ahead}")
        self.read_ahead = read_ahead
        if provider_wait_s < 0:
            raise BadRequest(f"provider_wait_s must not be negative, got {provider_wait_s}")
        flows = check_flows(flows, inflight)
        slots = shm_slots or inflight + 2
        if slots < 2:
            raise BadRequest(f"shm_slots must be at least 2 (one in use, one in flight), got {slots}")
        name_of_dataset = dataset.removeprefix("remote://")
        self.split = split
        self.batch_size = batch_size
        self.shuffle = (True if split == "train" else "none") if shuffle is None else shuffle
        self.seed = seed
        self.drop_last = drop_last
        where = detect(rank, world_size)
        self.rank, self.world_size, self.local_rank = where.rank, where.world_size, where.local_rank
        #: Whether this rank reads only its shard of the split (else the whole split).
        self.shard = (split == "train" or rank is not None) if shard is None else shard
        self._rank_source = where.source
        self._block_size = block_size
        sharded_world = where.world_size if self.shard else 1
        self._drop_uneven = sharded_world > 1 and split == "train" if drop_uneven is None else drop_uneven
        if transform is not None and not callable(transform):
            raise BadRequest(f"transform must be a callable taking a batch, got {type(transform).__name__}")
        self.transform = transform
        #: The record range read, ``(start, stop)``, or ``None`` for the whole split.
        self.samples = _record_range(samples)
        #: The skips, in the split's indices (:func:`libbus.order.epochs.check_skips`).
        self.skip = check_skips(skip)
        self._plan: Plan = None  # what is left of the current epoch after an elastic resume
        self._pass: weakref.ref | None = None  # the pass being iterated, if any
        self._running: _Running | None = None  # its thread (libbus.loader.handoff), kept after a whole pass
        # the running pass thread's hand-off, stopped if the loader is collected unclosed: a thread that
        # asks ahead for the next epoch would otherwise hold the connections (and the ring) for good
        self._live: list[Handoff] = []
        weakref.finalize(self, _stop_each, self._live).atexit = False
        self._stopping = threading.RLock()  # a signal handler's close() may come in on the consumer's thread
        # A pass has begun the cursor's epoch: the next pass takes the next one. Off after a pass
        # ends, and after set_epoch, rewind and load_state_dict (the next pass starts at the cursor).
        self._begun = False
        self._epoch = 0
        self._position = 0
        #: Seconds spent waiting for batches (not hidden by prefetch), summed over iterations.
        self.wait_s = 0.0
        #: The data-stall signal by replica, a Prometheus collector (:mod:`libbus.loader.stall`).
        self.stall = StallMeter(name_of_dataset, split)
        self.stall_breakdown = bool(stall_breakdown)
        self.device = torch.device(device)
        role = _role_of(token() if callable(token) else token)
        self._identity = Identity(
            role=role,
            name=name or f"loader-{socket.gethostname()}-{os.getpid()}",
            token=token,
            host_id=host_id or machine_id(),
            caps={"loader": True},  # many processes may share a reader (or trainer) token's loader sessions
            curve=curve,
            router_key=router_key,
        )
        links = Links(
            dataset=name_of_dataset,
            split=split,
            identity=self._identity,
            batch_size=batch_size,
            device=self.device,
            timeout_s=timeout_s,
            retries=retries,
            provider_wait_s=provider_wait_s,
            router=router,
            router_key=router_key,
            resolver=resolver,
            ctx=ctx or loader_context(),
            shm=shm,
            slots=slots,
            fixed_slots=bool(shm_slots),
            copy=copy,
            collate=collate,
            flows=flows,
        )
        entries = None
        if provider is not None:
            entries = entries_of(provider if isinstance(provider, list) else [provider])
            if provider_key and len(entries) == 1 and not entries[0]["curve_key"]:
                entries[0]["curve_key"] = provider_key.decode()
        #: The connections to the dataset's replicas (:mod:`libbus.loader.replica_set`).
        self.links = ReplicaSet(links, entries, inflight, grow)
        try:
            self._take_info(self.links.info)
        except BaseException:
            self.links.close()  # a bad seed or block size: the connections go now, not at collection
            raise
        _OPEN.add(self)  # closed at the interpreter's exit if the script never closes it

    def _take_info(self, info: dict) -> None:
        """The first provider's DatasetInfo: the split's size and the order this rank reads."""
        self.info = info
        name, split = self.links.links.dataset, self.split
        if not info["splits"][split].get("available", True):
            raise SplitPrivate(
                f"the {split} split of {name!r} never leaves its provider: have the provider score a model on "
                "it instead (busctl submit --evaluate --split test, docs/operations.md), or have its operator make it readable"
            )
        #: Samples in the split (or its record range ``samples``), on every rank together (``len(loader.dataset)``).
        self.num_samples = int(info["splits"][split]["num_samples"])
        if self.samples is not None:
            start, stop = self.samples
            if stop > self.num_samples:
                raise OutOfRange(
                    f"samples [{start}, {stop}) are past the {split} split of {name!r}: it has {self.num_samples}"
                )
            self.num_samples = stop - start
        #: The split served: ``len()`` its samples, ``str()`` and ``.name`` the dataset's name.
        self.dataset = DatasetSplit(name, split, self.num_samples, info)
        rank, world_size = (self.rank, self.world_size) if self.shard else (0, 1)
        self._order = Order(
            n=self.num_samples,
            seed=self.seed,
            shuffle=Shuffle.parse(self.shuffle),
            block_size=self._block_size,
            rank=rank,
            world_size=world_size,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            drop_uneven=self._drop_uneven,
            skip=shift_skips(self.skip, self.samples[0] if self.samples else 0, self.num_samples),
        )
        lo, hi = shard_bounds(self.num_samples, rank=rank, world_size=world_size, drop_uneven=self._drop_uneven)
        log.info(
            "%s/%s: rank %d of %d (%s, local rank %d) reads %s [%d, %d) of each epoch's %d samples, %d batches",
            name,
            split,
            self.rank,
            self.world_size,
            self._rank_source,
            self.local_rank,
            "shard" if self.shard else "the whole split",
            lo,
            hi,
            self.num_samples,
            len(self),
        )

    @property
    def shard_size(self) -> int:
        """Samples this rank reads in a whole epoch: its shard's, or the split's when not sharded.
        Summed over the ranks of a sharded evaluation, they are the split's samples read."""
        return self._order.shard_size

    @property
    def replicas(self) -> list[Replica]:
        """The replicas this loader talks to (those found down are dropped when a new one is found)."""
        return self.links.replicas

    @property
    def inflight(self) -> int:
        """Batch requests kept outstanding now (fewer while ring slots are quarantined)."""
        return self.links.inflight

    @property
    def flows(self) -> int:
        """Connections to each provider on another host (one to a same-host provider)."""
        return self.links.flows

    @property
    def provider_wait_s(self) -> float:
        return self.links.links.provider_wait_s

    @provider_wait_s.setter
    def provider_wait_s(self, seconds: float) -> None:
        self.links.links.provider_wait_s = seconds

    @property
    def timeout_s(self) -> float:
        return self.links.links.timeout_s

    @property
    def retries(self) -> int:
        return self.links.links.retries

    @property
    def provider(self) -> str:
        """The advertised endpoint of the first replica (same-host first)."""
        return self.replicas[0].endpoint if self.replicas else ""

    @property
    def endpoint(self) -> str:
        """Where the first replica's requests go: ``provider``, or its ``ipc://`` twin on this host."""
        return self.replicas[0].client.endpoint if self.replicas else ""

    @property
    def _ring(self) -> RingDelivery | None:
        return self.links.ring

    @property
    def _delivery(self) -> Delivery:
        return self.links.ring or self.links.socket

    @property
    def transport(self) -> str:
        """``"shm"`` when batches come through a shared-memory ring, else ``"socket"``."""
        return self.links.transport

    @property
    def epoch(self) -> int:
        """The cursor's epoch: of the pass under way (or the last one begun), else of the next pass.

        Right as soon as a state is loaded, also through a torchdata ``StatefulDataLoader`` that
        holds it for its next ``iter()`` (:func:`~libbus.loader.dataloader.pending_state`)."""
        self._adopt_pending()
        return self._epoch

    @property
    def position(self) -> int:
        """Samples of :attr:`epoch` this rank has handed out: with ``epoch``, the loader's cursor."""
        self._adopt_pending()
        return self._position

    def _adopt_pending(self) -> None:
        """Before the first pass: load the state a wrapping ``StatefulDataLoader`` holds for its next
        ``iter()`` now (it loads the same again then)."""
        if self._pass is None and not self._begun:
            state = pending_state(self)
            if state is not None:
                self.load_state_dict(state)

    def close(self) -> None:
        self._stop_pass()  # a pass still running owns the sockets until it ends
        self.links.close()

    def __enter__(self) -> RemoteLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def set_epoch(self, epoch: int) -> None:
        """Read ``epoch``'s order on the next pass, from its start (passes advance it on their own),
        as ``DistributedSampler.set_epoch``.

        Naming the epoch of a cursor :meth:`load_state_dict` restored, before any pass has begun it,
        keeps the cursor: a training loop's ``set_epoch(epoch)`` at the start of the resumed epoch
        (as ``DistributedSampler``-style loops make) continues at the restored sample.
        """
        self._adopt_pending()
        if epoch != self._epoch or self._begun:
            self.rewind(epoch)

    def rewind(self, epoch: int = 0) -> None:
        """Start ``epoch`` from its beginning on the next pass, forgetting any restored cursor (and
        the plan of an elastic resume)."""
        self._epoch, self._position, self._plan, self._begun = epoch, 0, None, False
        self._drop_ahead()

    def order(self, epoch: int) -> np.ndarray:
        """The sample indices this rank reads in ``epoch`` (after an elastic resume, in the resumed
        epoch: what is left of it for this rank)."""
        return elastic.indices(self._order, epoch, self._plan if epoch == self._epoch else None)

    def __len__(self) -> int:
        """Batches this rank yields in a whole pass (for ``train``, the same on every rank by default)."""
        return self._order.num_batches()

    def state_dict(self) -> dict[str, Any]:
        """The loader's cursor, JSON-ready: store it with a checkpoint to resume at the exact sample.
        Taken during a pass, the pass's epoch and the samples it has handed out.

        The form torchdata's ``StatefulDataLoader`` and ``torch.distributed.checkpoint``'s
        ``Stateful`` protocol take: a dict of plain values, read back by :meth:`load_state_dict`."""
        self._adopt_pending()
        out = elastic.state(self._order, self._epoch, self._position, self._plan)
        if self.samples is not None:
            out["first"] = self.samples[0]
        return out

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Continue at a saved cursor on the next pass, at this world size or another. ``epoch`` and
        ``position`` read the cursor at once (a cursor saved after an epoch's last sample reads as the
        start of the next epoch); the pass after that one is whole again.

        ``state`` is one cursor (from :meth:`state_dict` of any rank: under the same world size
        this rank continues at its position; under another, every old rank is taken to be at that
        position, as ranks in lock-step are), a list of every old rank's cursor, or one cursor
        merged from them (:func:`libbus.merge_cursors`). Under another world size the samples of
        the epoch no rank consumed are re-split over the new ranks, each read exactly once.

        Raises:
            BadRequest: a cursor saved with another dataset size, seed or shuffle (naming what
                differs), of another version, or a list that is not one cursor per old rank.
        """
        first = self.samples[0] if self.samples is not None else 0
        for one in [state] if isinstance(state, Mapping) else state:
            if isinstance(one, Mapping) and int(one.get("first", 0)) != first:
                raise BadRequest(
                    f"loader state was saved reading from sample {one.get('first', 0)} of the split, this loader "
                    f"reads from sample {first}: its position would point at other samples"
                )
        self._epoch, self._position, self._plan = elastic.restore(self._order, state)
        self._begun = False
        self._drop_ahead()

    def __iter__(self) -> Iterator[Any]:
        """One whole pass: the next epoch (or the one :meth:`set_epoch` named) from its start; the
        first pass after :meth:`load_state_dict`, the rest of the restored epoch. A pass left early
        leaves no trace on the next one, and ``len(loader)`` batches are a whole pass.

        The pass begins at its first batch: an iterator made and dropped unused (as torchdata's
        ``StatefulDataLoader`` makes one to read a state) takes nothing. A pass still open is closed
        first, its ring slots freed now.

        Raises:
            BadRequest: in a DataLoader worker process, or under a DataLoader that would batch the
                loader's batches again (its ``batch_size`` is not ``None``).
        """
        if torch.utils.data.get_worker_info() is not None:
            raise BadRequest(
                "RemoteLoader runs in the main process: use DataLoader(loader, batch_size=None, num_workers=0) "
                "(it prefetches by itself, inflight= requests ahead)"
            )
        refuse_rebatching(self)
        previous = self._pass() if self._pass is not None else None
        if previous is not None:
            previous.close()
        current = self._one_pass()
        self._pass = weakref.ref(current)
        return current

    def _one_pass(self) -> Iterator[Any]:
        if self._begun:  # the last pass began this epoch: this one is the next, whole
            self._epoch, self._position, self._plan = self._epoch + 1, 0, None
        self._begun = True
        epoch, position = self._epoch, self._position
        batches = batches_of(self.order(epoch), self.batch_size, self.drop_last, start=position)
        fetch = self._fetch(batches, epoch, self._carried_into(epoch, position, batches))
        try:
            for item, batch in zip(fetch, batches):
                position += len(batch)
                self._position = position  # counted when handed out: a checkpoint now includes it
                yield item if self.transform is None else self.transform(item)
        finally:
            fetch.close()  # frees ring slots now, not whenever the generator is collected
        self._epoch, self._position, self._plan, self._begun = epoch + 1, 0, None, False

    # -- the pass --------------------------------------------------------------------------------
    def _carried_into(self, epoch: int, position: int, batches: list[np.ndarray]) -> _Running | None:
        """The pass thread of the last pass, if it is asking ahead for exactly this pass: the last pass
        was whole, this one is the next epoch from its start, and the batches it asks for are these
        (compared sample by sample). Any other pass thread is stopped, its requests discarded."""
        with self._stopping:
            running = self._running
            if (
                running is not None
                and running.next_epoch == epoch
                and position == 0
                and self._plan is None
                and running.thread.is_alive()
                and running.handoff.going
            ):
                ahead = running.stream.segment_at(running.next_start)
                if ahead is not None and ahead.epoch == epoch and _same_batches(ahead.batches, batches):
                    running.next_epoch = None  # this pass's now
                    running.handoff.carry_on()
                    return running
        self._stop_pass()
        return None

    def _drop_ahead(self) -> None:
        """The next pass is no longer the one a whole pass asked ahead for (``set_epoch`` to another
        epoch, a loaded cursor, ``rewind``): its requests are discarded now, their ring slots freed."""
        running = self._running
        if running is None or running.next_epoch is None:
            return
        if (running.next_epoch, 0) != (self._epoch, self._position) or self._plan is not None:
            self._stop_pass()

    def _fetch(self, batches: list[np.ndarray], epoch: int, carried: _Running | None) -> Generator[Any, None, None]:
        """The pass's batches, made ready on a thread of the pass's own (:mod:`libbus.loader.handoff`), or
        on the last pass's thread when it is ``carried`` into this one; what this generator does itself
        is take each one, and count the time it had to wait.

        A pass taken to its end leaves its thread running: it asks ahead for the next epoch's first
        batches (:mod:`libbus.loader.batch_stream`), which the next pass takes when it is that epoch from
        its start (:meth:`_carried_into`); a pass left early, or failed, stops it."""
        if carried is not None:
            running, first = carried, carried.next_start
        else:
            if not batches:
                return
            order, size, drop_last = self._order, self.batch_size, self.drop_last

            def follow(next_epoch: int) -> list[np.ndarray]:  # holds no reference to the loader
                return batches_of(elastic.indices(order, next_epoch, None), size, drop_last)

            stream = BatchStream(epoch, batches, follow)
            pipeline = PassPipeline(
                self.links,
                dataset=self.dataset.name,
                split=self.split,
                first=self.samples[0] if self.samples is not None else 0,
                read_ahead=self.read_ahead if self.info.get("read_ahead") else 0,
                stall_breakdown=self.stall_breakdown,
            )
            handoff = Handoff()
            thread = threading.Thread(
                target=pipeline.run,
                args=(stream, handoff),
                name=f"batchbus-pass-{self.dataset.name}",
                daemon=True,
            )
            running, first = _Running(handoff, thread, stream), 0
            self._running = running
            self._live[:] = [handoff]
            thread.start()
        handoff = running.handoff
        whole = False
        try:
            for _ in batches:
                start = time.monotonic()
                got, blocked = handoff.ask()
                if isinstance(got, Raised):
                    raise got.error
                if isinstance(got, Ended):
                    return
                if blocked:  # waited for the data itself, not only for the hand-off
                    waited = time.monotonic() - start
                    self.wait_s += waited
                    self.stall.add(waited, got.replica)
                    if self.stall_breakdown:
                        self.stall.attribute(waited, got.round_trip_s, got.timing)
                yield got.item if got.handed else got.delivery.hand_out(got.batch_no, got.item)
            whole = True
        finally:
            with self._stopping:
                if whole and self._running is running:  # the thread asks ahead for the next epoch
                    running.next_epoch, running.next_start = epoch + 1, first + len(batches)
                else:
                    self._stop_pass(handoff)

    def _stop_pass(self, only: Handoff | None = None) -> None:
        """Stop the pass thread, if one runs (``only``: if it is that pass's), and wait for it (it
        owns the sockets until it ends); then a pass left early has its slots free again, and late
        replies are dropped. Whichever thread comes first does it: the consumer leaving the pass, or
        :meth:`close` on any thread."""
        with self._stopping:
            running = self._running
            if running is None or (only is not None and running.handoff is not only):
                return  # none runs, or another pass's (this one was stopped already)
            self._running = None
            handoff, thread = running.handoff, running.thread
            handoff.stop()
            if thread is not threading.current_thread():
                thread.join()
            handoff.drop_ready()  # batches asked ahead and made ready: their slots are free again
            self._live.clear()
            settle_ring_requests(self.links)
            for delivery in self.links.deliveries():
                delivery.reset()
            for replica in self.replicas:
                replica.take_pending()


@dataclass
class _Running:
    """A pass thread: its hand-off and the batches it asks for. After a whole pass, it asks ahead for
    ``next_epoch``, whose first batch is number ``next_start`` of ``stream``; ``None`` during a pass."""

    handoff: Handoff
    thread: threading.Thread
    stream: BatchStream
    next_epoch: int | None = None
    next_start: int = 0


def _same_batches(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def _stop_each(handoffs: list[Handoff]) -> None:
    """A collected loader's pass thread ends (its connections are then closed as they are collected)."""
    for handoff in handoffs:
        handoff.stop()


#: The loaders not yet collected (closed or not): :func:`_close_at_exit` closes those still open.
_OPEN: weakref.WeakSet[RemoteLoader] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """Close every loader a script left open, as the interpreter exits (before it finalizes).

    A script that ends with its last epoch, never calling :meth:`RemoteLoader.close`, leaves its pass
    thread asking ahead for the next epoch. A daemon thread still running into finalization is ended
    where it next takes the GIL, by an unwind that can abort the process ("terminate called without an
    active exception") where it crosses a C++ frame, as torch's are. Closing first ends the thread
    while the interpreter is whole, and says ``Goodbye`` to each provider."""
    for loader in list(_OPEN):
        try:
            loader.close()
        except Exception as err:  # noqa: BLE001 (the exit goes on; one loader's error is said)
            log.warning("closing a loader at exit: %s", err)


def _record_range(samples: tuple[int, int] | range | None) -> tuple[int, int] | None:
    """``samples`` as ``(start, stop)``, checked; :class:`BadRequest` for anything but a non-empty range."""
    if samples is None:
        return None
    if isinstance(samples, range):
        if samples.step != 1:
            raise BadRequest(f"samples must be a contiguous range, got {samples!r}")
        samples = (samples.start, samples.stop)
    ok = (
        isinstance(samples, (tuple, list))
        and len(samples) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in samples)
        and 0 <= samples[0] < samples[1]
    )
    if not ok:
        raise BadRequest(f"samples must be (start, stop) with 0 <= start < stop, got {samples!r}")
    return int(samples[0]), int(samples[1])
