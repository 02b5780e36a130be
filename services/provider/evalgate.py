"""What an ``Evaluate`` must pass before it runs: a bounded queue, a size cap on the weights, and a
rate per job and per token subject.

An evaluation scores weights on the provider's private test split: unthrottled, it is an oracle a
trainer could query to fit the test set, and each one holds the weights in memory and a worker
busy. The counters are read by ``stats()`` on the serving loop and written by the evaluation
worker thread, so they live here behind one lock.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

from libbus.constants import EVAL_MAX_MODEL_BYTES, EVAL_PER_MINUTE, EVAL_QUEUE
from libbus.errors import RateLimited, TooLarge

__all__ = ["EvalGate"]

#: Buckets idle this long are forgotten (a full bucket needs no memory).
_FORGET_S = 600.0


class EvalGate:
    """Admission and accounting of evaluations.

    Args:
        queue: most evaluations queued or running at once; more get ``RATE_LIMITED``.
        max_model_bytes: largest weights frame; larger gets ``TOO_LARGE``.
        per_minute: evaluations per minute per job and per subject (burst of the same size);
            0 = unlimited.
    """

    def __init__(
        self, queue: int = EVAL_QUEUE, max_model_bytes: int = EVAL_MAX_MODEL_BYTES, per_minute: float = EVAL_PER_MINUTE
    ):
        self.queue = queue
        self.max_model_bytes = max_model_bytes
        self.per_minute = per_minute
        #: Guards the counters here and whatever the evaluation thread updates for ``stats()``.
        self.lock = threading.Lock()
        self._admitted = 0  # queued or running
        self._running = 0
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, last refill)
        self.counts: Counter = Counter()

    def admit(self, subject: str, job: str, nbytes: int) -> None:
        """Take a place for one evaluation, or raise :class:`TooLarge` / :class:`RateLimited`."""
        if nbytes > self.max_model_bytes:
            self._count("refused_too_large")
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
            keys = [f"sub:{subject}"] + ([f"job:{job}"] if job else [])
            for key in keys:
                if self._tokens(key, now) < 1.0:
                    self.counts["refused_rate"] += 1
                    what = f"subject {subject!r}" if key.startswith("sub:") else f"job {job}"
                    raise RateLimited(
                        f"more than {self.per_minute:g} evaluations per minute for {what} "
                        "(eval_per_minute): the test split is not a training signal"
                    )
            for key in keys:
                tokens, _ = self._buckets[key]
                self._buckets[key] = (tokens - 1.0, now)
            self._admitted += 1
            self._forget(now)

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

    def _count(self, name: str) -> None:
        with self.lock:
            self.counts[name] += 1
