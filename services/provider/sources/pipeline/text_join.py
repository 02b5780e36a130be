"""``pack = { length = L, join = true }``: the documents' token stream cut into samples (docs/datasets.md §9.4).

GPT-style packing: every document's tokens (ending with the ``eos`` its ``tokenize`` stage appends),
concatenated in index order, cut into samples of ``L + 1`` tokens with no padding; the last partial
sample is dropped. Samples stay addressable by index, as every batchbus sample is (exact resume, rank
shards, shuffles, any indices in any order): when the pipeline opens, one pass over each split
tokenizes every document and keeps only its token count, as cumulative offsets (:class:`JoinIndex`,
8 bytes a document). Sample ``i`` covers tokens ``[i * (L + 1), (i + 1) * (L + 1))`` of its split's
stream, that is the run of documents :func:`numpy.searchsorted` finds in the offsets; a batch reads
and tokenizes again only the documents its samples touch. The tokens themselves are never kept.

The pass reads the documents in index order, in blocks, on the opening thread: the same files give
the same offsets, whatever the threads do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from libbus.errors import DatasetError
from libbus.wire.dataset_info import JoinSplitInfo

__all__ = ["INDEX_BLOCK", "JoinIndex", "count_tokens"]

log = logging.getLogger(__name__)

#: Documents tokenized at once by the open-time pass (``encode_batch`` spreads a block over its threads).
INDEX_BLOCK = 1024


def count_tokens(
    read: Callable[[np.ndarray], np.ndarray], documents: int, keep: Keep | None = None, block: int = INDEX_BLOCK
) -> np.ndarray:
    """Token counts (int64) of documents ``0 .. documents - 1``: ``read(indices)`` gives their token ids,
    which ``keep`` (if given) keeps while its budget lasts."""
    counts = np.empty(documents, np.int64)
    for start in range(0, documents, block):
        stop = min(documents, start + block)
        ids = read(np.arange(start, stop))
        counts[start:stop] = [len(v) for v in ids]
        if keep is not None:
            keep.add(ids)
    return counts


class Keep:
    """The token ids read by the open-time pass, kept (in ``dtype``) while they fit ``budget`` bytes."""

    def __init__(self, dtype: np.dtype, budget: int):
        self.dtype, self.budget = dtype, budget
        self.parts: list[np.ndarray] | None = [] if budget > 0 else None
        self.nbytes = 0

    def add(self, ids) -> None:
        if self.parts is None or not len(ids):
            return
        part = np.concatenate(list(ids)).astype(self.dtype, copy=False)
        self.nbytes += part.nbytes
        if self.nbytes > self.budget:  # too big: the batches tokenize their documents again
            self.parts = None
        else:
            self.parts.append(part)

    def stream(self) -> np.ndarray | None:
        if self.parts is None:
            return None
        return np.concatenate(self.parts) if self.parts else np.empty(0, self.dtype)


class JoinIndex:
    """One split's token stream: where each document's tokens start, and the samples cut from it.

    Args:
        counts: each document's number of tokens, in index order.
        width: tokens a sample holds (``length + 1``).
    """

    def __init__(self, counts: np.ndarray, width: int, stream: np.ndarray | None = None, cached: bool = False):
        self.width = width
        #: The counts came from the index cache (:mod:`.text_index_cache`), not from a pass at this open.
        self.cached = cached
        #: The whole split's token ids when they were kept (:class:`Keep`): samples are cut from it directly.
        self.stream = stream
        #: ``offsets[d]`` is where document ``d`` starts in the stream; ``offsets[-1]`` the stream's length.
        self.offsets = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=self.offsets[1:])
        self.tokens = int(self.offsets[-1])
        self.documents = len(counts)
        self.num_samples = self.tokens // width
        #: The tail too short for one more sample, dropped.
        self.dropped = self.tokens - self.num_samples * width

    @classmethod
    def build(
        cls, read: Callable[[np.ndarray], np.ndarray], documents: int, width: int, dtype: np.dtype, budget: int
    ) -> JoinIndex:
        """The index of a split of ``documents`` documents, each read (tokenized) once by ``read``; its
        token ids kept in memory if they take at most ``budget`` bytes (as ``dtype``)."""
        started = time.perf_counter()
        keep = Keep(dtype, budget)
        index = cls(count_tokens(read, documents, keep), width, keep.stream())
        seconds = time.perf_counter() - started
        log.info(
            "pack join: %d documents, %d tokens (%s), %d samples in %.2f s (%.0f documents/s)",
            documents,
            index.tokens,
            "kept in memory" if index.stream is not None else "not kept",
            index.num_samples,
            seconds,
            documents / seconds if seconds > 0 else 0.0,
        )
        return index

    def spans(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each sample, its first document and one past its last (documents overlapping its tokens)."""
        starts = samples.astype(np.int64) * self.width
        first = np.searchsorted(self.offsets, starts, "right") - 1
        stop = np.searchsorted(self.offsets, starts + self.width, "left")
        return first, stop

    def documents_of(self, samples: np.ndarray) -> np.ndarray:
        """The documents (sorted, each once) that ``samples`` need: what a batch reads and tokenizes."""
        first, stop = self.spans(samples)
        if not len(samples) or self.stream is not None:  # kept tokens: nothing to read
            return np.empty(0, np.int64)
        return np.unique(np.concatenate([np.arange(a, b) for a, b in zip(first.tolist(), stop.tolist())]))

    def assemble(self, samples: np.ndarray, documents: np.ndarray, tokens, dtype: np.dtype, where: str) -> np.ndarray:
        """``(len(samples), width)`` tokens from ``tokens[k]``, the ids of ``documents[k]`` (as
        :meth:`documents_of` listed them). Raises :class:`DatasetError` if a document's tokens are not
        as many as when the index was built (its file changed since the dataset was opened)."""
        if self.stream is not None:
            starts = samples.astype(np.int64)[:, None] * self.width
            return self.stream[starts + np.arange(self.width)].astype(dtype, copy=False)
        ids: dict[int, np.ndarray] = {}
        for doc, value in zip(documents.tolist(), tokens):
            expected = int(self.offsets[doc + 1] - self.offsets[doc])
            if len(value) != expected:
                raise DatasetError(
                    f"{where}: document {doc} has {len(value)} tokens, {expected} when the dataset was opened "
                    "(its files changed?); open the dataset again"
                )
            ids[doc] = value
        out = np.empty((len(samples), self.width), dtype)
        first, stop = self.spans(samples)
        for row, (sample, a, b) in enumerate(zip(samples.tolist(), first.tolist(), stop.tolist())):
            run = np.concatenate([ids[d] for d in range(a, b)]) if b - a > 1 else ids[a]
            skip = sample * self.width - int(self.offsets[a])
            out[row] = run[skip : skip + self.width]
        return out

    def info(self) -> JoinSplitInfo:
        return {
            "documents": self.documents,
            "tokens": self.tokens,
            "samples": self.num_samples,
            "dropped": self.dropped,
            "kept_mb": round(self.stream.nbytes / 2**20, 3) if self.stream is not None else 0,
            "cached": self.cached,
        }
