"""The provider's logic: its requests → replies. No sockets here.

:class:`ProviderHandler` holds what the provider serves and wires its parts together; each idea lives in
its own module, a mixin of the handler with the routes (``@serves``) of that idea:

- :mod:`.admission` — who may send what, the token's scope, and the router's assignments (requests
  wait here for the router's word): ``handle``, before any route;
- :mod:`.batches` — ``AttachRing``, ``BatchRequest``, ``ReadAhead``, ``LocateSamples``: the samples
  read, into a reply's frames or a trainer's ring (through :mod:`.fillers` and :mod:`.destination`);
- :mod:`.evaluations` — ``Evaluate``: a model scored here on a dataset's split;
- here: ``DatasetInfoRequest``, ``Stats`` (the records are :mod:`.metrics`'), ``StageControl``, and
  the glue (start, the tick, a session's end, close).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future

from libbus.constants import EVAL_TIMEOUT_S
from libbus.errors import NotFound
from libbus.serve.handler import serves
from libbus.serve.server import Handler, Session
from libbus.serve.sessions import reader_info
from libbus.wire.messages import (
    ChargeEvaluation,
    DatasetInfo,
    DatasetInfoRequest,
    EvaluationCharged,
    EvaluationReport,
    Message,
    Ok,
    StageControl,
    Stats,
    StatsReply,
)

from .admission import BATCH_READERS, READERS, Admission
from .batches import Batches, check_servable
from .destination import BatchCounters
from .evalgate import EvalGate
from .evaluations import Evaluations
from .fillers import REMOTE_READS, Fillers
from .metrics import ProviderStats, remote_read_stats, stats_within_scope
from .read_helper import HelpedSource, ReadHelper, with_helpers
from .score_release import Release
from .sources import PRIVATE_SPLIT, Source
from .sources.objstore import object_store_stats
from .sources.pipeline import pipeline_stats, stage_control

__all__ = ["ProviderHandler"]

log = logging.getLogger(__name__)


class ProviderHandler(Admission, Batches, Evaluations, Handler):
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
        self.init_admission(assigned_only)
        #: An ``ipc://`` endpoint on this socket for same-host peers (set by the service), or "".
        self.local_endpoint = ""
        self.init_batches()
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
        self.init_evaluations(
            eval_workers, evalgate, evaluator_modules, eval_timeout_s, release, report=report, charge=charge
        )
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
        self.stop_evaluations()
        for helped in self.helped.values():
            helped.helper.close()  # its reads under way fail, so the lanes waiting on them end
        self.fillers.close()  # the fills under way finish first: their rings are closed below
        for ring in self.rings.values():
            ring.close()
        self.rings.clear()
        for source in self.datasets.values():
            source.close()

    def tick(self, now: float) -> None:
        """Answer requests whose assignment arrived (or refuse those whose wait ran out); unmap
        rings their trainer has removed."""
        self.answer_waiting(now)
        self.unmap_removed_rings(now)

    def on_close(self, session: Session, reason: str) -> None:
        self.end_session_reads(session.sid)
        self.cancel_evaluations(session.sid)

    def source(self, name: str) -> Source:
        try:
            return self.datasets[name]
        except KeyError:
            raise NotFound(
                f"dataset {name!r} is not served here; this provider serves "
                f"{', '.join(sorted(self.datasets)) or 'nothing'}"
            ) from None

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
            "waiting_assignment": self.waiting_assignment,
            "refused": refused,
            "evaluations_running": running,
            "remote_reads": remote_read_stats({**self.datasets, **self.helped}),  # type: ignore[dict-item]
            "evaluations_queued": queued,
            **pipeline_stats(self.datasets),
            **with_helpers(object_store_stats(self.datasets), self.helped),
        }
