"""A provider's ``Evaluate`` requests, end to end: a model scored on a dataset's split here, where the data is.

The request is checked on the serving loop (dataset, split, model spec, weights' size) and takes a place
in the evaluation queue (:mod:`.evalgate`: queue, size and rate limits); a worker thread then loads and
scores the model (:mod:`.evaluator`, which imports torch on the first evaluation), spends one of the
dataset's evaluations at the router when the split is private (the router keeps each dataset's daily
budget and noise key), releases the score as :mod:`.score_release` allows, and reports a job's score to
the router before the reply. A session that goes away cancels its evaluations at their next chunk.

:class:`Evaluations` is a mixin of :class:`~.handler.ProviderHandler`, which provides the datasets and
what it knows of each, and the served counters.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import orjson

from libbus.errors import BadRequest, BusError, RateLimited, Unavailable
from libbus.jobs.weights import weights_digest
from libbus.serve.handler import serves
from libbus.serve.server import Session
from libbus.wire.dataset_info import SourceInfo
from libbus.wire.messages import ChargeEvaluation, Evaluate, Evaluation, EvaluationCharged, EvaluationReport
from libbus.wire.sockets import frame_len
from services.model_data import xy_info

from .admission import EVALUATORS
from .evalgate import Bound, EvalGate, check_model_spec
from .score_release import EXACT, Release
from .sources import PRIVATE_SPLIT, SPLITS, Source

__all__ = ["Evaluations"]

log = logging.getLogger(__name__)


class Evaluations:
    """A provider handler's ``Evaluate`` route: its admission, its worker, and what it tells the router."""

    infos: dict[str, SourceInfo]
    xy: dict[str, bool]
    readable_test: frozenset[str]
    served: dict[str, Counter]
    source: Callable[[str], Source]

    def init_evaluations(
        self,
        eval_workers: int,
        evalgate: EvalGate | None,
        evaluator_modules: frozenset[str],
        eval_timeout_s: float,
        release: Release | None,
        report: Callable[[EvaluationReport], object] | None,
        charge: Callable[[ChargeEvaluation], EvaluationCharged] | None,
    ) -> None:
        self._evaluator = ThreadPoolExecutor(eval_workers, thread_name_prefix="evaluate")
        #: Set by stop_evaluations(): running evaluations give up at their next chunk (the process can exit).
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
        #: session id → the bounds of its evaluations, cancelled when it goes away.
        self._bounds: dict[str, set[Bound]] = {}

    def stop_evaluations(self) -> None:
        """Running evaluations give up at their next chunk; queued ones never run."""
        self._closing.set()
        self._evaluator.shutdown(wait=False, cancel_futures=True)

    def cancel_evaluations(self, sid: str) -> None:
        """Session ``sid`` went away: its evaluations stop at their next chunk (nobody waits for them)."""
        for bound in self._bounds.pop(sid, set()):
            bound.cancel.set()

    @serves(Evaluate, *EVALUATORS)
    def on_Evaluate(self, session: Session, msg: Evaluate) -> Future:
        return self.evaluate(msg, session)

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
