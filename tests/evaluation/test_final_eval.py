"""A job's final test evaluation meets the provider's evaluation limits (services/provider/evalgate.py):
it waits its turn and asks again, instead of failing the job (seen in the chaos soak: a trainer that
finished more than ``eval_per_minute`` short jobs a minute had the rest fail ``RATE_LIMITED``)."""

from __future__ import annotations

import threading

from libbus.connect.client import Identity
from libbus.jobs.spec import JobSpec
from libbus.wire.messages import Resolve
from services.models import build_model
from services.trainer.attempt.final_eval import score_final


def test_final_evaluations_beyond_the_providers_queue_wait_their_turn(
    start_provider, router, client_for, make_token, make_settings
):
    provider = start_provider("mnist=mock://mnist?n=2000", eval_queue=1)
    # one router client per evaluation: a ZeroMQ socket is not thread-safe (a trainer's Link is)
    links = [client_for(router.endpoint, role="trainer", timeout_s=10.0) for _ in range(4)]
    resolved = links[0].request(Resolve(dataset="mnist"))
    spec = JobSpec(dataset="mnist", model="mlp", model_kwargs={"hidden": 32})
    settings = make_settings()
    results: dict[int, object] = {}

    def evaluate(i: int) -> None:
        model = build_model(spec.model, resolved.info, spec.model_kwargs)
        identity = Identity(role="trainer", name=f"t{i}", token=make_token("trainer", sub=f"t{i}"))
        try:
            results[i] = score_final(
                model,
                f"j{i}",
                spec,
                resolved.providers[0],
                link=links[i],
                identity=identity,
                settings=settings,
                check=lambda: None,
            )
        except Exception as err:  # noqa: BLE001 - the assertion below names it
            results[i] = err

    threads = [threading.Thread(target=evaluate, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    gate = provider.service.handler.evalgate
    assert gate.counts["refused_queue_full"] >= 1, "the four evaluations never met the one-place queue"
    assert all(type(r).__name__ == "Evaluation" for r in results.values()) and len(results) == 4, results
    assert all(r.n > 0 for r in results.values())  # type: ignore[attr-defined]
