"""A dataset's evaluation budget and noise key kept in the router's job database: one for every
provider asking, and the same after the router restarts on its database file."""

from __future__ import annotations

import pytest

from libbus.errors import RateLimited
from services.router.eval_budget import EvalBudget
from services.router.store import JobStore


def _open(path: str) -> tuple[JobStore, EvalBudget]:
    store = JobStore(path)
    return store, EvalBudget(store.db, store.durability)


def test_budget_spent_across_askers_and_kept_across_a_router_restart(tmp_path):
    path = str(tmp_path / "jobs.db")
    store, budget = _open(path)
    now = 1_000_000.0
    # two replicas of one dataset charge the same row: 3 a day in all, not 3 each
    assert budget.charge("mnist", 3, now) == 2.0
    assert budget.charge("mnist", 3, now + 1) == pytest.approx(1.0, abs=1e-3)
    store.close()
    store, budget = _open(path)  # the router restarts on its database
    assert budget.left("mnist", 3, now + 2) == pytest.approx(1.0, abs=1e-3)
    assert budget.charge("mnist", 3, now + 2) == pytest.approx(0.0, abs=1e-3)
    with pytest.raises(RateLimited, match="spent its 3 evaluations"):
        budget.charge("mnist", 3, now + 3)
    # another dataset has its own budget; a day later the spent one is whole again
    assert budget.charge("cifar", 3, now + 3) == 2.0
    assert budget.left("mnist", 3, now + 2 + 86400.0) == 3.0
    store.close()


def test_noise_key_made_once_per_dataset_and_kept_across_a_router_restart(tmp_path):
    path = str(tmp_path / "jobs.db")
    store, budget = _open(path)
    key = budget.key("mnist")
    assert len(key) == 32 and budget.key("mnist") == key
    other = budget.key("cifar")
    assert other != key
    store.close()
    store, budget = _open(path)
    assert budget.key("mnist") == key and budget.key("cifar") == other
    store.close()
