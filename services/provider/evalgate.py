"""What an ``Evaluate`` must pass before it runs: a bounded queue, a size cap on the weights and a rate
per job and per token subject. (A private test split's daily budget per dataset, whoever asks, is
kept at the router for every replica and restart: services/router/eval_budget.py; the provider
charges it there before it scores, with its ``per_dataset_day``.)

Admission (:meth:`EvalGate.admit`, on the serving loop) takes a place in the queue; the buckets are
charged only once the request proved valid (:meth:`EvalGate.charge`, on the worker, after the weights
loaded and fit): junk naming a victim's job must not spend that job's evaluations.

An evaluation scores weights on the provider's private test split: unthrottled, it is an oracle a
trainer could query to fit the test set, and each one holds the weights in memory and a worker
busy. The counters are read by ``stats()`` on the serving loop and written by the evaluation
worker thread, so they live here behind one lock.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field

from libbus.constants import EVAL_MAX_MODEL_BYTES, EVAL_PER_DATASET_DAY, EVAL_PER_MINUTE, EVAL_QUEUE
from libbus.errors import BadRequest, Forbidden, RateLimited, Timeout, TooLarge, Unavailable
from services.usercode import module_allowed

__all__ = ["Bound", "EvalGate", "check_model_spec"]

#: Buckets idle this long are forgotten (a full bucket needs no memory).
_FORGET_S = 600.0


class EvalGate:
    """Admission and accounting of evaluations.

    Args:
        queue: most evaluations queued or running at once; more get ``RATE_LIMITED``.
        max_model_bytes: largest weights frame; larger gets ``TOO_LARGE``.
        per_minute: evaluations per minute per job and per subject (burst of the same size);
            0 = unlimited.
        per_dataset_day: evaluations of a private test split per day per dataset, all subjects and
            replicas together: what this provider asks the router to count against (the bucket is
            the router's); 0 = unlimited.
    """

    def __init__(
        self,
        queue: int = EVAL_QUEUE,
        max_model_bytes: int = EVAL_MAX_MODEL_BYTES,
        per_minute: float = EVAL_PER_MINUTE,
        per_dataset_day: int = EVAL_PER_DATASET_DAY,
    ):
        self.queue = queue
        self.max_model_bytes = max_model_bytes
        self.per_minute = per_minute
        self.per_dataset_day = per_dataset_day
        #: Guards the counters here and whatever the evaluation thread updates for ``stats()``.
        self.lock = threading.Lock()
        self._admitted = 0  # queued or running
        self._running = 0
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, last refill)
        self.counts: Counter = Counter()

    def admit(self, subject: str, nbytes: int) -> None:
        """Take a place for one evaluation, or raise :class:`TooLarge` / :class:`RateLimited` (a full
        queue, or a subject with no evaluation left this minute: nothing is charged here)."""
        if nbytes > self.max_model_bytes:
            self.count("refused_too_large")
            raise TooLarge(
                f"model weights of {nbytes} bytes; this provider evaluates at most "
                f"{self.max_model_bytes} (eval_max_model_bytes)"
            )
        now = time.monotonic()
        with self.lock:
            if self._admitted >= self.queue:
                self.counts["refused_queue_full"] += 1
                raise RateLimited(
                    f"{self._admitted} evaluations are queued or running here; at most "
                    f"{self.queue} (eval_queue): try again when one finishes"
                )
            self._check_rate([f"sub:{subject}"], subject, "", now)
            self._admitted += 1
            self._forget(now)

    def charge(self, subject: str, job: str) -> None:
        """Spend one evaluation of ``subject`` and ``job`` (a validated request, about to be scored),
        or raise :class:`RateLimited` naming the limit that is spent."""
        now = time.monotonic()
        with self.lock:
            keys = [f"sub:{subject}"] + ([f"job:{job}"] if job else [])
            self._check_rate(keys, subject, job, now)
            for key in keys:
                tokens, _ = self._buckets[key]
                self._buckets[key] = (tokens - 1.0, now)

    def _check_rate(self, keys: list[str], subject: str, job: str, now: float) -> None:
        for key in keys:
            if self._tokens(key, now) < 1.0:
                self.counts["refused_rate"] += 1
                what = f"subject {subject!r}" if key.startswith("sub:") else f"job {job}"
                raise RateLimited(
                    f"more than {self.per_minute:g} evaluations per minute for {what} "
                    "(eval_per_minute): the test split is not a training signal"
                )

    def _tokens(self, key: str, now: float) -> float:
        if self.per_minute <= 0:
            self._buckets[key] = (float("inf"), now)
            return float("inf")
        tokens, last = self._buckets.get(key, (float(self.per_minute), now))
        tokens = min(float(self.per_minute), tokens + (now - last) * self.per_minute / 60.0)
        self._buckets[key] = (tokens, now)
        return tokens

    def _forget(self, now: float) -> None:
        if len(self._buckets) > 1024:
            self._buckets = {k: v for k, v in self._buckets.items() if now - v[1] < _FORGET_S}

    def started(self) -> None:
        with self.lock:
            self._running += 1

    def finished(self) -> None:
        """One admitted evaluation ended (from the worker thread), or will never start."""
        with self.lock:
            self._admitted -= 1

    def stopped_running(self) -> None:
        with self.lock:
            self._running -= 1

    def snapshot(self) -> tuple[int, int, dict]:
        """``(running, queued, counts)`` read together under the lock."""
        with self.lock:
            return self._running, self._admitted - self._running, dict(self.counts)

    def count(self, name: str) -> None:
        """Count a refusal (the router's budget refusals too: ``refused_budget``)."""
        with self.lock:
            self.counts[name] += 1


@dataclass(eq=False)  # one per evaluation, kept in sets: identity is its equality
class Bound:
    """When an evaluation must end: ``deadline`` (``time.monotonic()``), ``stop`` (the provider is
    stopping) or ``cancel`` (its caller went away)."""

    deadline: float
    timeout_s: float
    stop: threading.Event | None = None
    cancel: threading.Event = field(default_factory=threading.Event)

    def check(self) -> None:
        """Raise :class:`Unavailable` or :class:`Timeout` if the evaluation must end now."""
        if self.stop is not None and self.stop.is_set():  # a SIGTERM must not wait for a whole split
            raise Unavailable("the provider is stopping; evaluation abandoned: ask again")
        if self.cancel.is_set():
            raise Unavailable("the caller went away; evaluation abandoned")
        if time.monotonic() > self.deadline:
            raise Timeout(f"the evaluation ran past its {self.timeout_s:g} s bound (eval_timeout_s) and was stopped")


def check_model_spec(model_spec: object, evaluator_modules: Collection[str]) -> None:
    """The cheap checks of ``Evaluate.model``, before any admission is charged (nothing imported).

    Raises :class:`BadRequest` for a malformed spec, :class:`Forbidden` for an evaluator whose module
    the provider's ``evaluator_modules`` does not allow.
    """
    if not isinstance(model_spec, dict) or not isinstance(model_spec.get("kwargs", {}), dict):
        raise BadRequest(
            'Evaluate.model must be {"name": str, "kwargs": {...}} or {"evaluator": "module:function", ...}'
        )
    unknown = set(model_spec) - {"name", "evaluator", "kwargs"}
    if unknown or ("name" in model_spec) == ("evaluator" in model_spec):
        raise BadRequest(
            f"Evaluate.model names exactly one of name (a built-in) or evaluator, with kwargs; got {sorted(model_spec)}"
        )
    if "name" in model_spec:
        if not isinstance(model_spec["name"], str):
            raise BadRequest("Evaluate.model.name must be a string")
        return  # a built-in's name is checked on the worker (services.models imports torch)
    ref = model_spec["evaluator"]
    if not isinstance(ref, str) or ref.count(":") != 1:
        raise BadRequest(f"Evaluate.model.evaluator must be 'package.module:function', got {ref!r}")
    if not module_allowed(ref.partition(":")[0], evaluator_modules):
        listed = ", ".join(sorted(evaluator_modules)) or "none"
        raise Forbidden(
            f"evaluator {ref!r}: its module is not in this provider's evaluator_modules ({listed}); only "
            "modules its operator lists there (config file or BATCHBUS_EVALUATOR_MODULES) may run, "
            "nothing was imported"
        )
