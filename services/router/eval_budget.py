"""Each dataset's evaluation budget and noise key, kept in the router's job database.

A private test split's scores are released against a daily budget and with noise keyed by a secret
(services/provider/score_release.py). Kept in a provider process, both would be that process's: two
replicas of a dataset would each spend a full budget, and a restarted provider would start a fresh
budget and a fresh key. Kept here, in the router's SQLite file, per dataset (its canonical name),
they are one for every replica and every restart of the providers, and they survive a router
restart. A provider charges one evaluation here before it scores (``ChargeEvaluation``) and fails
closed when the router cannot say.

The budget is a bucket of ``per_day`` evaluations refilled over a day of wall-clock time (the
router's clock; a restart must not refill it). The key is 32 random bytes drawn once per dataset
and never shown to anyone but the dataset's providers.

Used by the router's single loop thread, on the job store's connection and its ``Durability``
(every charge is written before the router replies), for a provider's ``ChargeEvaluation``
(services/router/handler.py), which states its ``eval_per_dataset_day`` as ``per_day``: replicas
given the same setting share one bucket of that size; replicas given different ones each charge the
one bucket against their own size, so a day holds at most the largest.
"""

from __future__ import annotations

import secrets
import sqlite3
import time

from libbus.errors import RateLimited

from .store_db import Durability

__all__ = ["EvalBudget"]

_DAY_S = 86400.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS eval_budget (
    dataset TEXT PRIMARY KEY,
    tokens  REAL NOT NULL,
    last    REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS eval_keys (
    dataset TEXT PRIMARY KEY,
    key     BLOB NOT NULL
);
"""


class EvalBudget:
    """The per-dataset evaluation budget and noise key on the router's database connection."""

    def __init__(self, db: sqlite3.Connection, durability: Durability):
        self.db = db
        self.durability = durability
        self.db.executescript(_SCHEMA)

    def left(self, dataset: str, per_day: int, now: float | None = None) -> float:
        """Evaluations ``dataset`` may still release now (``inf`` when ``per_day`` is 0: unlimited)."""
        if per_day <= 0:
            return float("inf")
        now = time.time() if now is None else now
        row = self.db.execute("SELECT tokens, last FROM eval_budget WHERE dataset = ?", (dataset,)).fetchone()
        cap = float(per_day)
        if row is None:
            return cap
        tokens, last = float(row[0]), float(row[1])
        return min(cap, tokens + max(0.0, now - last) * cap / _DAY_S)

    def charge(self, dataset: str, per_day: int, now: float | None = None) -> float:
        """Spend one evaluation of ``dataset`` and return how many are left, or raise
        :class:`RateLimited` when its ``per_day`` are spent (nothing is charged then)."""
        now = time.time() if now is None else now
        tokens = self.left(dataset, per_day, now)
        if tokens < 1.0:
            raise RateLimited(
                f"dataset {dataset!r} has spent its {per_day} evaluations of the day (eval_per_dataset_day): "
                "every score of its private test split leaks a little of it (counted at the router, for "
                "all of the dataset's providers together)"
            )
        if per_day <= 0:
            return tokens
        with self.durability.write():
            self.db.execute(
                "INSERT INTO eval_budget (dataset, tokens, last) VALUES (?, ?, ?) "
                "ON CONFLICT(dataset) DO UPDATE SET tokens = excluded.tokens, last = excluded.last",
                (dataset, tokens - 1.0, now),
            )
        return tokens - 1.0

    def key(self, dataset: str) -> bytes:
        """``dataset``'s noise key: drawn from the OS the first time it is asked for, the same after."""
        row = self.db.execute("SELECT key FROM eval_keys WHERE dataset = ?", (dataset,)).fetchone()
        if row is not None:
            return bytes(row[0])
        key = secrets.token_bytes(32)
        with self.durability.write():
            self.db.execute("INSERT OR IGNORE INTO eval_keys (dataset, key) VALUES (?, ?)", (dataset, key))
        return bytes(self.db.execute("SELECT key FROM eval_keys WHERE dataset = ?", (dataset,)).fetchone()[0])
