"""The provider's logic: DatasetInfo, Batch and Evaluate requests → replies. No sockets here."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TypeVar

import numpy as np
import orjson

from libbus.constants import EVAL_TIMEOUT_S, MAX_FRAMES, MAX_HEADER_BYTES, MAX_LOCATE_INDICES
from libbus.errors import (
    BadRequest,
    BusError,
    ConfigError,
    Forbidden,
    NotFound,
    OutOfRange,
    RateLimited,
    ShmError,
    SplitPrivate,
    TooLarge,
    Unavailable,
)
from libbus.jobs.weights import weights_digest
from libbus.security.auth import Claims
from libbus.serve.handler import serves
from libbus.serve.server import Handler, ServerStats, Session
from libbus.serve.sessions import reader_info
from libbus.wire.messages import (
    AttachRing,
    BatchRequest,
    BatchResponse,
    ChargeEvaluation,
    DatasetInfo,
    DatasetInfoRequest,
    Evaluate,
    Evaluation,
    EvaluationCharged,
    EvaluationReport,
    LocateSamples,
    Message,
    Ok,
    ReadAhead,
    RingAttached,
    SampleLocations,
    StageControl,
    Stats,
    StatsReply,
)
from libbus.wire.msg_data import indices_frame
from libbus.wire.sockets import frame_len
from services.model_data import xy_info
from shm import Ring, RingLayout

from .destination import (
    BatchCounters,
    DatasetServed,
    Destination,
    Frames,
    Slot,
    batch_bytes,
    check_batch_size,
    write_batch,
)
from .evalgate import Bound, EvalGate, check_model_spec
from .fillers import REMOTE_READS, Fillers
from .read_helper import HelpedSource, ReadHelper, with_helpers
from .score_release import EXACT, Release
from .sources import PRIVATE_SPLIT, SPLITS, Source
from .sources.objstore import object_store_stats
from .sources.pipeline import pipeline_stats, stage_control
from .sources.pipeline.engine import PipelineRow
from .sources.storage.blockmemory import ReadStats
from .sources.storage.objects import ObjectStoreRow

__all__ = ["ProviderHandler", "check_servable"]


def _chain(done: Future, into: Future) -> None:
    """Copy a finished future's outcome into another."""
    err = done.exception()
    if err is None:
        into.set_result(done.result())
    else:
        into.set_exception(err)


class ProviderStats(PipelineRow, ObjectStoreRow):
    """A provider handler's own stats (its ``Stats`` reply, after its server's figures on its heartbeats and
    metrics): what it served and refused, its evaluations, its remote reads; ``pipelines``,
    ``decode_cache`` and ``object_store`` where it has them."""

    #: Per dataset, what it served.
    datasets: dict[str, DatasetServed]
    #: Batch requests waiting for the router to assign their trainer.
    waiting_assignment: int
    #: Requests refused, by reason.
    refused: dict[str, int]
    evaluations_running: int
    #: Per remote dataset read from files, how its reads go now.
    remote_reads: dict[str, ReadStats]
    evaluations_queued: int


class ProviderBeat(ServerStats, ProviderStats):
    """A provider's heartbeat stats (its row of the router's ``Stats``): its server's figures, then its
    handler's."""


class ProviderRow(ProviderBeat):
    """What a provider's metrics read: its heartbeat stats, and whether its link to the router is up."""

    connected: bool


V = TypeVar("V")


def remote_read_stats(datasets: dict[str, Source]) -> dict[str, ReadStats]:
    """Per remote dataset read from files (``http(s)://``, an object store): its requests in flight and
    their limit now, and its RAM cache's counters (``busctl queues --json``, the metrics)."""
    out = {}
    for name, source in datasets.items():
        location = getattr(source, "location", None)
        if source.remote and location is not None:
            out[name] = location.stats()
    return out


def stats_within_scope(stats: ProviderStats, claims: Claims) -> ProviderStats:
    """``stats`` as ``claims`` may see them: a scoped token (a tenant's) sees the per-dataset rows of
    the datasets its ``datasets`` scope names and of no other (a ``jobs`` scope alone names none), so
    it learns neither the names nor the reads of other tenants' datasets; an unrestricted token all."""
    if not claims.scopes:
        return stats
    named = "datasets" in claims.scopes

    def seen(rows: Mapping[str, V]) -> dict[str, V]:
        return {d: v for d, v in rows.items() if named and claims.allows_dataset(d)}

    out = stats.copy()
    out["datasets"] = seen(stats["datasets"])
    out["remote_reads"] = seen(stats["remote_reads"])
    if "pipelines" in stats:
        out["pipelines"] = seen(stats["pipelines"])
    return out


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


log = logging.getLogger(__name__)

READERS = ("trainer", "admin")
#: Who may read batches: a reader token's loader too (a script's token: its datasets, no jobs, no
#: evaluations; libbus/security/auth.py ROLES), and an attempt's grant (its job's dataset).
BATCH_READERS = ("trainer", "reader", "admin", "attempt")
#: Who may have a model scored: an attempt's grant too, for its own job only.
EVALUATORS = ("trainer", "admin", "attempt")
#: Ended sessions remembered so that their batches still waiting in a lane are dropped (a lane's wait is
#: seconds; sessions end far more slowly than that).
ENDED_KEPT = 4096
#: How often the provider looks for rings their trainers have removed.
RING_CHECK_S = 1.0
#: How long a request from a trainer not (yet) assigned to a job on its dataset waits for the
#: router's word before FORBIDDEN: a trainer given a task connects at once, and the router's
#: Entitlements push may still be on its way.
ASSIGNMENT_WAIT_S = 3.0
#: A provider that has not yet heard from the router at all (just started, its link still connecting
#: on a loaded machine) knows nothing of assignments: its waits begin once the router's first word
#: arrives, and a request still waiting this long without it gets UNAVAILABLE (retryable), never a
#: FORBIDDEN that would fail the job of a trainer the router did assign.
UNSYNCED_WAIT_S = 30.0


class ProviderHandler(Handler):
    """Serves named datasets to trainers; keeps the test split for its own evaluator."""

    def __init__(
        self,
        datasets: dict[str, Source],
        *,
        host_id: str = "",
        shm: bool = True,
        eval_workers: int = 1,
        assigned_only: bool = True,
        evalgate: EvalGate | None = None,
        fill_thread: bool | None = None,
        fill_threads: int = 0,
        remote_reads: int = REMOTE_READS,
        helpers: dict[str, ReadHelper] | None = None,
        readable_test: frozenset[str] = frozenset(),
        evaluator_modules: frozenset[str] = frozenset(),
        eval_timeout_s: float = EVAL_TIMEOUT_S,
        release: Release | None = None,
        report: Callable[[EvaluationReport], object] | None = None,
        charge: Callable[[ChargeEvaluation], EvaluationCharged] | None = None,
    ):
        super().__init__()
        self.datasets = datasets
        self.host_id = host_id
        self.shm = shm
        #: Serve a trainer only the datasets of its current job (or its token's explicit scope).
        self.assigned_only = assigned_only
        #: ``{dataset: {token subject}}`` of trainers on a job, as the router last said. Replaced
        #: whole from the router link's thread; read on the serving loop.
        self.assigned: dict[str, frozenset[str]] = {}
        #: When the router's first Entitlements arrived (None: not yet; see UNSYNCED_WAIT_S).
        self.synced_at: float | None = None
        #: Requests waiting for an assignment: (deadline, session, message, future).
        self._waiting: list[tuple[float, Session, Message, Future]] = []
        #: An ``ipc://`` endpoint on this socket for same-host peers (set by the service), or "".
        self.local_endpoint = ""
        self._rings_checked = 0.0
        #: session id → the ring its trainer attached (one per session; a new AttachRing replaces it).
        self.rings: dict[str, Ring] = {}
        self.infos = {name: source.info() for name, source in datasets.items()}
        #: Datasets whose operator marked the test split readable (``private_test=false``): served
        #: like train and val, and said so in their DatasetInfo.
        self.readable_test = readable_test
        for name in readable_test:
            self.infos[name]["splits"][PRIVATE_SPLIT].update({"available": True, "shuffle": True})
        #: Each dataset's fields, and whether it is an x/y dataset (served through ``serve_into``).
        self.fields = {name: source.fields for name, source in datasets.items()}
        self.xy = {name: source.xy for name, source in datasets.items()}
        for name, source in datasets.items():
            check_servable(name, source)
        self._evaluator = ThreadPoolExecutor(eval_workers, thread_name_prefix="evaluate")
        #: Set by close(): running evaluations give up at their next chunk (the process can exit).
        self._closing = threading.Event()
        #: Evaluation admission (queue, size, rate) and the counters the worker thread writes.
        self.evalgate = evalgate or EvalGate()
        #: The modules whose evaluators may score models here (the provider's evaluator_modules).
        self.evaluator_modules = evaluator_modules
        self.eval_timeout_s = eval_timeout_s
        #: What a score of a private test split may say (services/provider/score_release.py).
        self.release = release or Release()
        #: Sends a job's evaluation to the router (the service sets it to its link's request).
        self.report = report
        #: Spends one of a dataset's evaluations at the router and returns its noise key (the
        #: service sets it to its link's request; None: no router, and no private score is released).
        self.charge = charge
        #: The latest sessions ended (bounded, oldest out): batches of theirs still waiting are not read.
        self._ended: OrderedDict[str, None] = OrderedDict()
        #: session id → the datasets it sent a ReadAhead for (their plans end with the session).
        self._read_ahead: dict[str, set[str]] = {}
        #: session id → the bounds of its evaluations, cancelled when it goes away.
        self._bounds: dict[str, set[Bound]] = {}
        #: Served and refused batches, and batch latency: counted from the loop and the fill threads
        #: alike, under the evaluation counters' lock (stats() reads them under it).
        self.counters = BatchCounters(datasets, self.evalgate.lock)
        self.served, self.refused, self.latency = self.counters.served, self.counters.refused, self.counters.latency
        #: Where batches are read (the loop, or each dataset's own lanes: :mod:`.fillers`), and
        #: through which rings are unmapped once no fill writes into them.
        self.fillers = Fillers(fill_thread, fill_threads, remote_reads)
        #: Datasets read in a helper process (:mod:`.read_helper`): the source their batches are read through.
        self.helped = {name: HelpedSource(datasets[name], helper) for name, helper in (helpers or {}).items()}

    def close(self) -> None:
        self._closing.set()
        self._evaluator.shutdown(wait=False, cancel_futures=True)
        for helped in self.helped.values():
            helped.helper.close()  # its reads under way fail, so the lanes waiting on them end
        self.fillers.close()  # the fills under way finish first: their rings are closed below
        for ring in self.rings.values():
            ring.close()
        self.rings.clear()
        for source in self.datasets.values():
            source.close()

    def set_assigned(self, assigned: dict[str, list[str]]) -> None:
        """Take the router's assignments (any thread: one reference swap)."""
        self.assigned = {name: frozenset(subs) for name, subs in assigned.items()}
        if self.synced_at is None:
            self.synced_at = time.monotonic()

    def tick(self, now: float) -> None:
        """Answer requests whose assignment arrived (or refuse those whose wait ran out); unmap
        rings their trainer has removed (a closed loader sends no goodbye): the mapping would
        otherwise keep the memory in use until the session expires."""
        if self._waiting:
            self._recheck_waiting(now)
        if now - self._rings_checked < RING_CHECK_S:
            return
        self._rings_checked = now
        for sid in [sid for sid, ring in self.rings.items() if not ring.segment.path.exists()]:
            log.info("ring %s was removed by its trainer; unmapped", self.rings[sid].name)
            self.fillers.rings.close(self.rings.pop(sid))

    def on_close(self, session: Session, reason: str) -> None:
        self._ended[session.sid] = None  # its batches still waiting in a lane are not read
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)
        for name in self._read_ahead.pop(session.sid, ()):  # its loaders are gone: their plans too
            self.helped.get(name, self.datasets[name]).read_ahead("train", np.empty(0, np.int64), (session.sid, name))
        for bound in self._bounds.pop(session.sid, set()):
            bound.cancel.set()  # its evaluations stop at their next chunk: nobody waits for them
        ring = self.rings.pop(session.sid, None)
        if ring is not None:
            self.fillers.rings.close(ring)

    def source(self, name: str) -> Source:
        try:
            return self.datasets[name]
        except KeyError:
            raise NotFound(
                f"dataset {name!r} is not served here; this provider serves "
                f"{', '.join(sorted(self.datasets)) or 'nothing'}"
            ) from None

    def check_scope(self, session: Session, msg: Message) -> None:
        """Refuse (FORBIDDEN) a request for a dataset or job outside the token's scopes. A ring
        carries no dataset: it is refused only to a token that may read nothing served here."""
        claims = session.claims
        if isinstance(msg, (BatchRequest, DatasetInfoRequest, Evaluate, LocateSamples, ReadAhead)):
            claims.check_dataset(msg.dataset)
        if isinstance(msg, Evaluate) and msg.job:
            claims.check_job(msg.job)
        if isinstance(msg, Evaluate) and not msg.job and session.role == "attempt":
            raise Forbidden("an attempt's grant scores models for its own job only: Evaluate must name it")
        if isinstance(msg, AttachRing) and not any(claims.allows_dataset(d) for d in self.datasets):
            raise Forbidden(
                f"this token's datasets scope [{', '.join(claims.scopes['datasets'])}] "
                f"covers none of the datasets served here ({', '.join(sorted(self.datasets))})"
            )

    def entitled(self, session: Session, msg: Message) -> bool:
        """Whether the router has entitled this peer to what ``msg`` reads: admins and readers always
        (a reader's grant is its token's ``datasets`` scope, checked before); a trainer when it runs a
        job on the dataset, or its token names datasets explicitly, or ``assigned_only`` is off; an
        attempt's grant (scoped by the router to its job's dataset) while its trainer runs a job there."""
        if session.role not in ("trainer", "attempt") or not self.assigned_only:
            return True
        if session.role == "trainer" and "datasets" in session.claims.scopes:
            return True
        sub = session.claims.sub
        if isinstance(msg, (BatchRequest, DatasetInfoRequest, Evaluate, LocateSamples, ReadAhead)):
            return sub in self.assigned.get(msg.dataset, ())
        if isinstance(msg, AttachRing):
            return any(sub in self.assigned.get(name, ()) for name in self.datasets)
        return True

    def handle(self, session: Session, msg: Message) -> Message | Future | None:
        try:
            self.check_scope(session, msg)
        except Forbidden:
            self.refused["scope"] += 1
            raise
        if not self.entitled(session, msg):
            fut: Future = Future()
            self._waiting.append((time.monotonic() + ASSIGNMENT_WAIT_S, session, msg, fut))
            return fut
        return self.serve(session, msg)

    def _recheck_waiting(self, now: float) -> None:
        still = []
        for deadline, session, msg, fut in self._waiting:
            if self.entitled(session, msg):
                try:
                    reply = self.serve(session, msg)
                except Exception as err:  # noqa: BLE001 - a BusError goes to the peer, others as INTERNAL
                    fut.set_exception(err)
                    continue
                if isinstance(reply, Future):
                    reply.add_done_callback(partial(_chain, into=fut))
                else:
                    fut.set_result(reply)
            elif self.synced_at is None:
                if now > deadline - ASSIGNMENT_WAIT_S + UNSYNCED_WAIT_S:
                    fut.set_exception(
                        Unavailable(
                            "this provider has not heard from the router yet, so it knows no assignments; ask again"
                        )
                    )
                else:
                    still.append((deadline, session, msg, fut))
            elif now > max(deadline, self.synced_at + ASSIGNMENT_WAIT_S):
                self.refused["unassigned"] += 1
                what = getattr(msg, "dataset", "") or "any dataset served here"
                fut.set_exception(
                    Forbidden(
                        f"{session.claims.sub!r} is not assigned to a job on {what}; the router assigns "
                        "trainers to jobs (or issue a token scoped to the dataset: busctl token issue --dataset)"
                    )
                )
            else:
                still.append((deadline, session, msg, fut))
        self._waiting = still

    def serve(self, session: Session, msg: Message) -> Message | Future | None:
        """Answer an admitted, entitled request (its :func:`serves` method)."""
        return self.dispatch(session, msg)

    @serves(DatasetInfoRequest, *BATCH_READERS)
    def on_DatasetInfoRequest(self, session: Session, msg: DatasetInfoRequest) -> DatasetInfo:
        self.source(msg.dataset)
        return DatasetInfo(
            dataset=msg.dataset,
            info=dict(reader_info(self.infos[msg.dataset], session.claims)),  # the message's JSON object
            host_id=self.host_id,
            local_endpoint=self.local_endpoint,
        )

    @serves(Evaluate, *EVALUATORS)
    def on_Evaluate(self, session: Session, msg: Evaluate) -> Future:
        return self.evaluate(msg, session)

    @serves(Stats, *READERS)
    def on_Stats(self, session: Session, msg: Stats) -> StatsReply:
        return StatsReply(services={"provider": stats_within_scope(self.stats(), session.claims)})

    @serves(StageControl, "admin")
    def on_StageControl(self, session: Session, msg: StageControl) -> Ok:
        detail = stage_control(
            self.datasets, msg.dataset, msg.stage, msg.command, msg.args, session.claims.check_dataset
        )
        log.info("%s: %s %s/%s %s", session.name, msg.command, detail["dataset"], msg.stage, msg.args)
        return Ok(detail=detail)

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
        # names slots must keep it. Mappings of a ring its trainer removed go in `tick`.
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
        self._check_split(msg.dataset, msg.split)
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
        self._check_split(msg.dataset, msg.split)
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
        self._check_split(msg.dataset, msg.split)
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

    def _check_split(self, dataset: str, split: str) -> None:
        if split not in SPLITS:
            raise BadRequest(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        if split == PRIVATE_SPLIT and dataset not in self.readable_test:
            self.counters.refuse("split_private")
            raise SplitPrivate(
                f"the {PRIVATE_SPLIT} split of {dataset!r} never leaves its "
                "provider; ask for an evaluation instead (Evaluate), or, where nothing needs hiding, "
                "have its operator serve it with private_test=false"
            )

    def evaluate(self, msg: Evaluate, session: Session | None = None) -> Future:
        """Check ``msg`` (cheaply, here on the loop), take a place in the evaluation queue, and score
        it on the worker (:meth:`_score`): a Future of the :class:`Evaluation`."""
        source = self.source(msg.dataset)
        if msg.split not in SPLITS:
            raise BadRequest(f"unknown split {msg.split!r}; expected one of {', '.join(SPLITS)}")
        check_model_spec(msg.model, self.evaluator_modules)
        if "name" in msg.model and not self.xy[msg.dataset]:
            try:  # a built-in model reads named fields image and label, as it trained on them
                xy_info(self.infos[msg.dataset])
            except BadRequest as err:
                raise BadRequest(f"{msg.dataset!r}: {err.message}; or name an evaluator (model.evaluator)") from err
        weights = msg.frames[0]
        gate = self.evalgate
        subject = session.claims.sub if session else ""
        gate.admit(subject, frame_len(weights))
        blob = bytes(weights.buffer if hasattr(weights, "buffer") else weights)
        bound = Bound(time.monotonic() + self.eval_timeout_s, self.eval_timeout_s, self._closing)
        sid = session.sid if session else ""
        self._bounds.setdefault(sid, set()).add(bound)

        def run() -> Evaluation:
            gate.started()
            try:
                # torch is imported here, on the first evaluation: a provider that only serves
                # batches starts in a fraction of the time.
                return self._score(msg, source, blob, subject, bound)
            finally:
                gate.stopped_running()
                gate.finished()

        def done(fut: Future) -> None:  # (any thread) the session's list forgets it
            self._bounds.get(sid, set()).discard(bound)
            if fut.cancelled():  # cancelled before it ran (the provider stopping)
                gate.finished()

        try:
            fut = self._evaluator.submit(run)
        except RuntimeError:  # shut down: nothing will run it
            gate.finished()
            self._bounds[sid].discard(bound)
            raise Unavailable("this provider is stopping; evaluate elsewhere or later") from None
        fut.add_done_callback(done)
        return fut

    def _score(self, msg: Evaluate, source: Source, blob: bytes, subject: str, bound: Bound) -> Evaluation:
        """On the worker: load and check the weights, charge the limits, score, release, report."""
        from .evaluator import prepare, score

        bound.check()  # its caller may have left while it was queued
        started = time.monotonic()
        info = self.infos[msg.dataset]
        prepared = prepare(msg.model, blob, info, self.evaluator_modules)
        self.evalgate.charge(subject, msg.job)
        private = msg.split == PRIVATE_SPLIT and msg.dataset not in self.readable_test
        release = self.release if private else EXACT
        key = self._charge_budget(msg.dataset) if private else b""
        scores = score(prepared, source, msg.split, info, bound, xy=self.xy[msg.dataset])
        digest = hashlib.sha256(blob).hexdigest()
        # the noise is keyed by the tensors (names, dtypes, shapes, bytes), not the file: the same
        # weights under other metadata are the same question, and get the same answer
        question = orjson.dumps([weights_digest(blob), msg.model, msg.dataset, msg.split], option=orjson.OPT_SORT_KEYS)
        loss, accuracy, metrics = release(question, scores.loss, scores.accuracy, scores.n, scores.metrics, key)
        log.info(
            "evaluated job %s on %s/%s: loss %.4f accuracy %.4f (%d samples, %.1f s)",
            msg.job or "-",
            msg.dataset,
            msg.split,
            loss,
            accuracy,
            scores.n,
            time.monotonic() - started,
        )
        with self.evalgate.lock:  # stats() reads these on the serving loop
            self.served[msg.dataset]["evaluations"] += 1
        if msg.job and self.report is not None:
            self._report(
                EvaluationReport(
                    job=msg.job,
                    dataset=msg.dataset,
                    subject=subject,
                    split=msg.split,
                    loss=loss,
                    accuracy=accuracy,
                    n=scores.n,
                    metrics=metrics,
                    sha256=digest,
                    epsilon=release.epsilon,
                )
            )
        return Evaluation(
            loss=loss, accuracy=accuracy, n=scores.n, metrics=metrics, sha256=digest, epsilon=release.epsilon
        )

    def _charge_budget(self, dataset: str) -> bytes:
        """Spend one of ``dataset``'s evaluations of its private test split at the router, which keeps
        the dataset's daily budget for all its replicas and restarts, and return the dataset's noise
        key (b"" where there is nothing to count or hide: no budget and exact scores). Fails closed:
        raises :class:`RateLimited` when the day's evaluations are spent and :class:`Unavailable`
        when the router cannot say; nothing is scored or released then."""
        per_day = self.evalgate.per_dataset_day
        if per_day <= 0 and self.release.epsilon <= 0:
            return b""
        if self.charge is None:
            raise Unavailable(
                f"{dataset!r}: this provider has no router to charge the evaluation to (the router keeps each "
                "dataset's evaluation budget and noise key); no score of its private test split is released"
            )
        try:
            reply = self.charge(ChargeEvaluation(dataset=dataset, per_day=per_day))
            key = bytes.fromhex(reply.key)
        except RateLimited:
            self.evalgate.count("refused_budget")
            raise
        except (BusError, ValueError) as err:
            raise Unavailable(
                f"the router, which keeps {dataset!r}'s evaluation budget and noise key, did not grant this "
                f"evaluation ({err}); no score was released: ask again once the router answers"
            ) from err
        if len(key) < 16:
            raise Unavailable(f"the router gave {dataset!r} a noise key of {len(key)} bytes; no score was released")
        return key

    def _report(self, report: EvaluationReport) -> None:
        """Tell the router what was released for a job (before the reply: the trainer's result comes
        after it). A router that cannot hear it costs the job its recorded score, not the reply."""
        try:
            self.report(report)  # type: ignore[misc]
        except BusError as err:
            log.warning("job %s: the router did not take this evaluation's report: %s", report.job, err)

    def stats(self) -> ProviderStats:
        running, queued, counts = self.evalgate.snapshot()
        with self.counters.lock:  # the evaluation and fill threads count into served and refused
            datasets = self.counters.datasets()
            refused = dict(self.refused)
        for key in ("refused_too_large", "refused_queue_full", "refused_rate", "refused_budget"):
            if counts.get(key):
                refused["evaluate_" + key[len("refused_") :]] = counts[key]
        return {
            "datasets": datasets,
            "waiting_assignment": len(self._waiting),
            "refused": refused,
            "evaluations_running": running,
            "remote_reads": remote_read_stats({**self.datasets, **self.helped}),  # type: ignore[dict-item]
            "evaluations_queued": queued,
            **pipeline_stats(self.datasets),
            **with_helpers(object_store_stats(self.datasets), self.helped),
        }
