"""The provider's logic: DatasetInfo, Batch and Evaluate requests → replies. No sockets here."""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from libbus.constants import MAX_BATCH_BYTES, MAX_BATCH_INDICES
from libbus.errors import BadRequest, NotFound, OutOfRange, SplitPrivate, TooLarge
from libbus.messages import (BatchRequest, BatchResponse, DatasetInfo, DatasetInfoRequest, Evaluate,
                             Evaluation, Message, Stats, StatsReply)
from libbus.server import Handler, Session
from libbus.sockets import frame_len

from .evaluator import evaluate_weights
from .sources import PRIVATE_SPLIT, SPLITS, Source

__all__ = ["ProviderHandler", "batch_indices"]

log = logging.getLogger(__name__)

READERS = ("trainer", "admin")


def batch_indices(msg: BatchRequest, num_samples: int, split: str) -> np.ndarray:
    """The int64 indices a BatchRequest names, checked against the split's size.

    Raises :class:`BadRequest` (neither or both of range/frame, bad frame), :class:`TooLarge`
    (too many indices) or :class:`OutOfRange` (naming the first bad index).
    """
    if msg.range is not None and msg.frames:
        raise BadRequest("BatchRequest gives both a range and an indices frame; send one")
    if msg.range is not None:
        r = msg.range
        if (len(r) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in r)
                or r[0] > r[1]):
            raise BadRequest(f"BatchRequest.range must be [start, end) integers with start <= end, got {r}")
        start, end = r
        if end - start > MAX_BATCH_INDICES:
            raise TooLarge(f"range of {end - start} samples; at most {MAX_BATCH_INDICES} per request")
        if start < 0 or end > num_samples:
            raise OutOfRange(f"range [{start}, {end}) is outside {split} (0..{num_samples})")
        return np.arange(start, end, dtype=np.int64)
    if not msg.frames:
        raise BadRequest("BatchRequest needs a range or an int64 indices frame")
    frame = msg.frames[0]
    size = frame_len(frame)
    if size % 8:
        raise BadRequest(f"indices frame is {size} bytes; expected a multiple of 8 (int64)")
    if size // 8 > MAX_BATCH_INDICES:
        raise TooLarge(f"{size // 8} indices; at most {MAX_BATCH_INDICES} per request")
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    indices = np.frombuffer(buf, dtype="<i8")
    if len(indices):
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= num_samples:
            bad = lo if lo < 0 else hi
            raise OutOfRange(f"index {bad} is outside {split} (0..{num_samples - 1})")
    return indices


class ProviderHandler(Handler):
    """Serves named datasets to trainers; keeps the test split for its own evaluator."""

    roles = {
        "DatasetInfoRequest": READERS,
        "BatchRequest": READERS,
        "Evaluate": READERS,
        "Stats": READERS,
    }

    def __init__(self, datasets: dict[str, Source], *, eval_workers: int = 1):
        super().__init__()
        self.datasets = datasets
        self.infos = {name: source.info() for name, source in datasets.items()}
        self.served: dict[str, Counter] = defaultdict(Counter)
        self.refused: Counter = Counter()
        self._evaluator = ThreadPoolExecutor(eval_workers, thread_name_prefix="evaluate")
        self._evaluations_running = 0

    def close(self) -> None:
        self._evaluator.shutdown(wait=False, cancel_futures=True)

    def source(self, name: str) -> Source:
        try:
            return self.datasets[name]
        except KeyError:
            raise NotFound(f"dataset {name!r} is not served here; this provider serves "
                           f"{', '.join(sorted(self.datasets)) or 'nothing'}") from None

    def handle(self, session: Session, msg: Message) -> Message | Future | None:
        if isinstance(msg, BatchRequest):
            return self.batch(msg)
        if isinstance(msg, DatasetInfoRequest):
            self.source(msg.dataset)
            return DatasetInfo(dataset=msg.dataset, info=self.infos[msg.dataset])
        if isinstance(msg, Evaluate):
            return self.evaluate(msg)
        if isinstance(msg, Stats):
            return StatsReply(services={"provider": self.stats()})
        raise BadRequest(f"provider does not serve {msg.type}")

    def batch(self, msg: BatchRequest) -> BatchResponse:
        source = self.source(msg.dataset)
        if msg.split not in SPLITS:
            raise BadRequest(f"unknown split {msg.split!r}; expected one of {', '.join(SPLITS)}")
        if msg.split == PRIVATE_SPLIT:
            self.refused["split_private"] += 1
            raise SplitPrivate(f"the {PRIVATE_SPLIT} split of {msg.dataset!r} never leaves its "
                               "provider; ask for an evaluation instead (Evaluate)")
        indices = batch_indices(msg, source.num_samples(msg.split), msg.split)
        if len(indices) * source.sample_nbytes > MAX_BATCH_BYTES:
            raise TooLarge(f"{len(indices)} samples of {source.sample_nbytes} bytes exceed the "
                           f"{MAX_BATCH_BYTES} byte batch limit")
        x, y = source.read(msg.split, indices)
        x, y = np.ascontiguousarray(x), np.ascontiguousarray(y)
        counters = self.served[msg.dataset]
        counters["batches"] += 1
        counters["samples"] += len(indices)
        counters["bytes"] += x.nbytes + y.nbytes
        return BatchResponse(shapes=[list(x.shape), list(y.shape)], dtypes=[x.dtype.str, y.dtype.str],
                             nbytes=x.nbytes + y.nbytes, frames=[x.data, y.data])

    def evaluate(self, msg: Evaluate) -> Future:
        source = self.source(msg.dataset)
        if msg.split not in SPLITS:
            raise BadRequest(f"unknown split {msg.split!r}; expected one of {', '.join(SPLITS)}")
        weights = msg.frames[0]
        blob = bytes(weights.buffer if hasattr(weights, "buffer") else weights)
        self._evaluations_running += 1
        started = time.monotonic()

        def run() -> Evaluation:
            try:
                loss, acc, n = evaluate_weights(source, msg.split, msg.model, blob, self.infos[msg.dataset])
                log.info("evaluated job %s on %s/%s: loss %.4f accuracy %.4f (%d samples, %.1f s)",
                         msg.job or "-", msg.dataset, msg.split, loss, acc, n, time.monotonic() - started)
                self.served[msg.dataset]["evaluations"] += 1
                return Evaluation(loss=loss, accuracy=acc, n=n)
            finally:
                self._evaluations_running -= 1

        return self._evaluator.submit(run)

    def stats(self) -> dict:
        return {"datasets": {name: dict(c) for name, c in self.served.items()},
                "refused": dict(self.refused), "evaluations_running": self._evaluations_running}
