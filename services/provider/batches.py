"""What a provider serves of its datasets' samples: batches (into a reply's frames or a trainer's ring slot),
the rings they are written into, read-ahead plans, and where samples live.

Each request is checked on the serving loop (dataset, split — the test split never leaves unless its
operator made it readable —, indices, size) before anything is read; the read itself goes to the
dataset's filler (services/provider/fillers.py), which writes the batch into its destination
(services/provider/destination.py). docs/architecture.md "One BatchRequest, function by function" walks it.

:class:`Batches` is a mixin of :class:`~.handler.ProviderHandler`, which provides the datasets and what
it knows of each, the counters, the fillers, and the helper processes some datasets are read in.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial

import numpy as np

from libbus.constants import MAX_FRAMES, MAX_HEADER_BYTES, MAX_LOCATE_INDICES
from libbus.errors import (
    BadRequest,
    ConfigError,
    Forbidden,
    OutOfRange,
    ShmError,
    SplitPrivate,
    TooLarge,
    Unavailable,
)
from libbus.serve.handler import serves
from libbus.serve.server import Session
from libbus.wire.fields import Field
from libbus.wire.messages import (
    AttachRing,
    BatchRequest,
    BatchResponse,
    LocateSamples,
    Ok,
    ReadAhead,
    RingAttached,
    SampleLocations,
)
from libbus.wire.msg_data import indices_frame
from shm import Ring, RingLayout

from .admission import BATCH_READERS
from .destination import (
    BatchCounters,
    Destination,
    Frames,
    Slot,
    batch_bytes,
    check_batch_size,
    write_batch,
)
from .fillers import Fillers
from .read_helper import HelpedSource
from .sources import PRIVATE_SPLIT, SPLITS, Source

__all__ = ["Batches", "check_servable", "ENDED_KEPT", "RING_CHECK_S"]

log = logging.getLogger(__name__)

#: Ended sessions remembered so that their batches still waiting in a lane are dropped (a lane's wait is
#: seconds; sessions end far more slowly than that).
ENDED_KEPT = 4096
#: How often the provider looks for rings their trainers have removed.
RING_CHECK_S = 1.0


def check_servable(dataset: str, source: Source) -> None:
    """Refuse (at start-up) a dataset that no batch could be served of: encoded images or text, alone
    or mixed (they have no fixed shape and feed a pipeline's ``decode`` or ``tokenize`` stage), or
    fields whose batches need more payload frames than a message may carry (one per fixed field, two
    per variable one, at most ``MAX_FRAMES - 2``). Raises :class:`ConfigError`."""
    if source.kind == "encoded":
        raise ConfigError(
            f"dataset {dataset!r} ({source.uri}) holds encoded images or text, which have no fixed shape: "
            "make it a pipeline's source (decode or tokenize stages: docs/datasets.md §9.3, §9.4), or serve "
            "images with ?size=S or ?fields=image,label"
        )
    fields = source.fields
    need = sum(2 if f.variable else 1 for f in fields)
    if need > MAX_FRAMES - 2:
        raise ConfigError(
            f"dataset {dataset!r} has {len(fields)} fields, whose batches need {need} frames; a message "
            f"carries at most {MAX_FRAMES - 2} (one per fixed field, two per variable one): serve fewer"
        )


class Batches:
    """A provider handler's sample reads: the ``AttachRing``, ``BatchRequest``, ``ReadAhead`` and
    ``LocateSamples`` routes, and the rings and read-ahead plans of its sessions."""

    datasets: dict[str, Source]
    host_id: str
    shm: bool
    readable_test: frozenset[str]
    fields: dict[str, list[Field]]
    xy: dict[str, bool]
    refused: dict[str, int]
    counters: BatchCounters
    fillers: Fillers
    helped: dict[str, HelpedSource]
    source: Callable[[str], Source]

    def init_batches(self) -> None:
        self._rings_checked = 0.0
        #: session id → the ring its trainer attached (one per session; a new AttachRing replaces it).
        self.rings: dict[str, Ring] = {}
        #: The latest sessions ended (bounded, oldest out): batches of theirs still waiting are not read.
        self._ended: OrderedDict[str, None] = OrderedDict()
        #: session id → the datasets it sent a ReadAhead for (their plans end with the session).
        self._read_ahead: dict[str, set[str]] = {}

    def unmap_removed_rings(self, now: float) -> None:
        """Unmap rings their trainer has removed (a closed loader sends no goodbye): the mapping would
        otherwise keep the memory in use until the session expires. Looks once a ``RING_CHECK_S``."""
        if now - self._rings_checked < RING_CHECK_S:
            return
        self._rings_checked = now
        for sid in [sid for sid, ring in self.rings.items() if not ring.segment.path.exists()]:
            log.info("ring %s was removed by its trainer; unmapped", self.rings[sid].name)
            self.fillers.rings.close(self.rings.pop(sid))

    def end_session_reads(self, sid: str) -> None:
        """A session ended: its batches still waiting in a lane are not read, its read-ahead plans end,
        and its ring is let go (once no fill writes into it)."""
        self._ended[sid] = None
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)
        for name in self._read_ahead.pop(sid, ()):  # its loaders are gone: their plans too
            self.helped.get(name, self.datasets[name]).read_ahead("train", np.empty(0, np.int64), (sid, name))
        ring = self.rings.pop(sid, None)
        if ring is not None:
            self.fillers.rings.close(ring)

    @serves(AttachRing, *BATCH_READERS)
    def attach_ring(self, session: Session, msg: AttachRing) -> RingAttached:
        """Map the session's trainer's ring, after checking it is this host's, private and sane."""
        if not self.shm:
            raise Unavailable("shared memory is disabled on this provider (shm = false)")
        if session.hello.host_id != self.host_id:
            raise Unavailable(
                f"ring offered from host {session.hello.host_id!r}; this provider runs on {self.host_id!r}"
            )
        if not session.local:  # a remote peer claiming this host's id, or another user
            self.refused["ring"] += 1
            raise Forbidden(
                "AttachRing is accepted only over this provider's same-host ipc:// "
                f"endpoint from its own user; this peer came from {session.peer or '?'}"
            )
        layout = RingLayout(msg.slots, msg.slot_bytes, msg.label_offset)
        try:
            ring = Ring.attach(msg.name, layout)
        except ShmError as err:
            self.refused["ring"] += 1
            raise BadRequest(f"ring refused: {err}") from err
        # This session's earlier ring is let go now. The same ring may stay mapped for another
        # session: a loader attaches its one ring on each session it has here (two replicas on one
        # endpoint, or a reconnect whose old session has not expired yet), and a session that still
        # names slots must keep it. Mappings of a ring its trainer removed go in `unmap_removed_rings`.
        old = self.rings.pop(session.sid, None)
        if old is not None:
            self.fillers.rings.close(old)
        self.rings[session.sid] = ring
        log.info(
            "session %s (%s) attached ring %s: %d slots of %d bytes",
            session.sid,
            session.name,
            msg.name,
            msg.slots,
            msg.slot_bytes,
        )
        return RingAttached(name=msg.name)

    @serves(BatchRequest, *BATCH_READERS)
    def batch(self, session: Session, msg: BatchRequest) -> BatchResponse | Future:
        """Check ``msg`` and begin its destination (a stale ring slot is refused here, on the loop),
        then write the batch there on the filler its source's read policy names: the reply, or a
        Future of it that the server sends when it completes."""
        started = time.perf_counter()
        source = self.source(msg.dataset)
        self.check_split(msg.dataset, msg.split)
        indices = msg.indices(source.num_samples(msg.split))
        fields = None if self.xy[msg.dataset] else self.fields[msg.dataset]
        check_batch_size(source, fields, len(indices))  # bounded before it is read, on the loop
        dest: Destination
        if msg.slot is None and msg.seq is None:
            dest = Frames(msg, self.counters)
        else:
            dest = Slot.begin(msg, self.counters, self.rings.get(session.sid))
        filler = self.fillers.for_batch(msg.dataset, source, dest.ring)
        # a batch still waiting in its lane when its session ends (a loader closed, or gone) is not read:
        # nobody would take it, and a remote store's reads cost the other datasets
        ended = partial(self._ended.__contains__, session.sid) if session is not None else None
        reader = self.helped.get(msg.dataset, source)  # a helper process's reads, or the source's own
        reply = filler.run(write_batch, reader, msg, indices, dest, fields, started, ended, ring=dest.ring)
        if isinstance(reply, Future) and dest.ring is None:
            # what its reply will hold, for the connection's budget of unread replies (libbus/serve/backlog.py)
            reply.expected_bytes = batch_bytes(source, fields, len(indices))  # type: ignore[attr-defined]
        return reply

    @serves(ReadAhead, *BATCH_READERS)
    def read_ahead(self, session: Session, msg: ReadAhead) -> Ok:
        """Plan the blocks a loader's next samples lie in (its dataset's RAM cache fetches them ahead),
        refused as a batch of them would be; the plan replaces the session's last one for the dataset."""
        source = self.source(msg.dataset)
        self.check_split(msg.dataset, msg.split)
        indices = indices_frame(msg.frames[0], msg.split, source.num_samples(msg.split))
        planned = self.helped.get(msg.dataset, source).read_ahead(msg.split, indices, (session.sid, msg.dataset))
        if planned or len(indices) == 0:
            self._read_ahead.setdefault(session.sid, set()).add(msg.dataset)
        return Ok(detail={"blocks": planned})

    @serves(LocateSamples, *BATCH_READERS)
    def locate(self, session: Session, msg: LocateSamples) -> SampleLocations:
        """Where samples ``msg.indices`` of ``msg.split`` live (:meth:`Source.locate`: paths relative to
        the dataset's root, never the provider's own), refused as a batch of them would be."""
        source = self.source(msg.dataset)
        self.check_split(msg.dataset, msg.split)
        indices = msg.indices
        if not isinstance(indices, list) or not all(type(i) is int for i in indices):
            raise BadRequest("LocateSamples: indices must be a list of integers")
        if len(indices) > MAX_LOCATE_INDICES:
            raise TooLarge(
                f"LocateSamples asks for {len(indices)} indices; at most {MAX_LOCATE_INDICES} a request "
                "(split the list)"
            )
        n = source.num_samples(msg.split)
        bad = next((i for i in indices if not 0 <= i < n), None)
        if bad is not None:
            raise OutOfRange(f"index {bad} is outside {msg.dataset}/{msg.split} (0..{n - 1})")
        locations = source.locate(msg.split, np.asarray(indices, dtype=np.int64))
        if sum(len(s) + 4 for s in locations) > MAX_HEADER_BYTES // 2:
            raise TooLarge(f"the locations of {len(indices)} samples do not fit one reply; ask for fewer")
        return SampleLocations(locations=locations)

    def check_split(self, dataset: str, split: str) -> None:
        """Refuse an unknown split, and the private test split of a dataset that keeps it (counted)."""
        if split not in SPLITS:
            raise BadRequest(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        if split == PRIVATE_SPLIT and dataset not in self.readable_test:
            self.counters.refuse("split_private")
            raise SplitPrivate(
                f"the {PRIVATE_SPLIT} split of {dataset!r} never leaves its "
                "provider; ask for an evaluation instead (Evaluate), or, where nothing needs hiding, "
                "have its operator serve it with private_test=false"
            )
