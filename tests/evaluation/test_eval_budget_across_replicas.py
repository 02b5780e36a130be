"""A private test split's daily evaluation budget and noise key are the dataset's, kept at the router:
two provider replicas and a router restart between their releases together release no more than
``eval_per_dataset_day``, and the same tensors get the same noise from either replica, before and after
the restart (docs/security.md §9). A provider that cannot reach the router releases nothing."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import save as save_safetensors

from libbus.errors import RateLimited, Unavailable
from libbus.wire.messages import Evaluate, ListPeers
from services import views
from services.router.app import RouterService
from tests.support import run_service

ALLOWED = ["tests.support.evaluators"]
MODEL = {"evaluator": "tests.support.evaluators:linear"}
#: Bound on waits for a provider to register again (a loaded machine reconnects in seconds).
WAIT_S = 60.0


def _weights(seed: int, **metadata: str) -> bytes:
    torch.manual_seed(seed)
    layer = torch.nn.Linear(784, 10)
    tensors = {"weight": layer.weight.detach().contiguous(), "bias": layer.bias.detach().contiguous()}
    return save_safetensors(tensors, metadata=metadata or None)


def _providers_registered(admin, n: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            providers = [p for p in admin.request(ListPeers()).peers if p["role"] == "provider"]
        except Unavailable:  # (the router not yet up)
            providers = []
        if len(providers) >= n:
            return
        assert time.monotonic() < deadline, f"{len(providers)} of {n} providers registered with the router"
        time.sleep(0.1)


def test_replicas_and_a_router_restart_share_one_budget_and_one_noise_key(
    router, start_provider, client_for, make_settings
):
    flags = {"evaluator_modules": ALLOWED, "eval_per_minute": 0, "eval_per_dataset_day": 3, "eval_epsilon": 0.1}
    replicas = [start_provider("mnist=mock://mnist?n=600", name=f"replica-{i}", **flags) for i in (1, 2)]
    one, two = (client_for(p.endpoint, timeout_s=60) for p in replicas)

    def released(client, blob: bytes) -> tuple[float, float]:
        reply = client.request(Evaluate(dataset="mnist", model=MODEL, frames=[blob]))
        return reply.loss, reply.accuracy

    def left_today(admin) -> int | None:  # what busctl datasets and busctl web show of the budget
        return {row["dataset"]: row for row in views.datasets(admin)}["mnist"]["evaluations_left_today"]

    before = client_for(router.endpoint, role="admin", timeout_s=10)
    _providers_registered(before, 2)
    assert left_today(before) == 3
    first = released(one, _weights(0, job="a"))
    # the same tensors, relabelled, asked of the other replica: the same question, the same answer
    assert released(two, _weights(0, job="b", note="another file")) == first

    # the router restarts on its database (the same endpoint); meanwhile no score is released
    router.shutdown()
    with pytest.raises(Unavailable, match="evaluation budget and noise key"):
        released(one, _weights(1))
    settings = make_settings(bind=router.endpoint)  # the same state directory: the same router.db
    again = run_service(RouterService(settings), settings)
    try:
        admin = client_for(again.endpoint, role="admin", timeout_s=10, retries=2)
        _providers_registered(admin, 2)
        # the key survived the restart; this is the day's third evaluation, whoever serves it
        assert released(two, _weights(0, job="c")) == first
        for client in (one, two):  # both replicas refuse the fourth: 3 a day in all, not 3 each
            with pytest.raises(RateLimited, match=r"spent its 3 evaluations of the day \(eval_per_dataset_day\)"):
                released(client, _weights(2))
        refused = [p.service.handler.stats()["refused"].get("evaluate_budget", 0) for p in replicas]
        assert refused == [1, 1], refused
        assert left_today(admin) == 0
    finally:
        again.shutdown()
