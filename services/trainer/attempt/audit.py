"""Opt-in audit of what a trainer trained on (setting ``audit_dir``), to check exactly-once delivery.

Each attempt at a job writes ``<audit_dir>/<job>.<trainer>.<pid>.<n>.jsonl``: a first line
``{"job", "trainer", "started", "resumed_from_step", "rank", "attempt"}`` (``attempt``: the router's
number of the assignment, which every rank of one gang shares), then one line per batch trained on,
``{"epoch", "step", "t", "samples": [digest, ...]}`` (``t``: when, Unix seconds), a digest being the first 16 hex characters of the
blake2b of the sample's bytes and its label's bytes as the trainer received them. The lines are
flushed as written, so a trainer killed with SIGKILL leaves every batch it trained on.

:func:`effective_epochs` replays the attempts of a job: an attempt resumed from step ``S`` discards
what earlier attempts trained after ``S`` (that model state was lost with them) — what remains is
what the final model saw, per epoch, whatever rank or world size each attempt had.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import orjson
import torch

__all__ = ["Audit", "digest", "effective_epochs"]

_attempts = itertools.count()


def digest(sample: bytes, label: bytes) -> str:
    return hashlib.blake2b(sample + b"|" + label, digest_size=8).hexdigest()


class Audit:
    """Appends the digests of every trained batch of one attempt at ``job``."""

    def __init__(self, directory: str, job: str, trainer: str, resumed_from_step: int, rank: int = 0, attempt: int = 0):
        path = Path(directory) / f"{job}.{trainer}.{os.getpid()}.{next(_attempts)}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(path, "ab")
        self._write(
            {
                "job": job,
                "trainer": trainer,
                "started": time.time(),
                "resumed_from_step": resumed_from_step,
                "rank": rank,
                "attempt": attempt,
            }
        )

    def _write(self, record: dict) -> None:
        self._fh.write(orjson.dumps(record) + b"\n")
        self._fh.flush()

    def record(self, epoch: int, step: int, x: torch.Tensor, y: torch.Tensor) -> None:
        xs, ys = x.detach().cpu().numpy(), y.detach().cpu().numpy()
        self._write(
            {
                "epoch": epoch,
                "step": step,
                "t": time.time(),
                "samples": [digest(xs[i].tobytes(), ys[i].tobytes()) for i in range(len(xs))],
            }
        )

    def close(self) -> None:
        self._fh.close()


def effective_epochs(directory: str | Path, job: str) -> dict[int, Counter]:
    """Per epoch, the multiset of sample digests the job's final model was trained on.

    An attempt's batches after step ``S`` are cut by a later attempt resumed from ``S``. Later is
    told by the router's attempt number, which every rank of one assignment shares (so the ranks of
    one gang never cut each other, however their batches interleave in time, and an elastic gang
    resumed at another world size cuts every rank of the one before). Files written before the
    number was recorded fall back to time: a later attempt of the same rank, or of any rank once it
    began after this one's last batch."""
    attempts = []
    for path in Path(directory).glob(f"{job}.*.jsonl"):
        lines = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
        if lines:
            head, records = lines[0], lines[1:]
            ended = max([head["started"], *(b.get("t", head["started"]) for b in records)])
            attempts.append(
                _Attempt(
                    head["started"],
                    ended,
                    head.get("rank", 0),
                    head.get("attempt"),
                    int(head["resumed_from_step"]),
                    records,
                )
            )
    epochs: dict[int, Counter] = {}
    for one in attempts:
        cut = min((other.resumed for other in attempts if other.supersedes(one)), default=None)
        for b in one.records:
            if cut is None or b["step"] <= cut:
                epochs.setdefault(b["epoch"], Counter()).update(b["samples"])
    return epochs


@dataclass(frozen=True)
class _Attempt:
    """One audit file: when it began and ended, its rank, the router's attempt number (``None`` in
    files from before it was recorded), the step it resumed from, and its batches."""

    started: float
    ended: float
    rank: int
    number: int | None
    resumed: int
    records: list

    def supersedes(self, other: _Attempt) -> bool:
        """Whether this attempt came after ``other`` and so discards what ``other`` trained after
        this one's resumed step."""
        if self.number is not None and other.number is not None:
            return self.number > other.number
        return self.started > other.started and (self.rank == other.rank or self.started > other.ended)
