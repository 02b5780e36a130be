"""``busctl job samples`` and ``busctl job skip --steps`` make the router compute an epoch's whole
order, over as many samples as the job's ``train_range`` says (or a checkpoint's cursor reports): a
tenant's job over 10^12 samples is refused before any order is computed, and the router serves on.
"""

from __future__ import annotations

import pytest

from libbus.errors import BadRequest
from libbus.jobs.spec import JobSpec
from libbus.order import history
from libbus.wire.messages import GetJobSamples, GetTask, ListJobs, SkipJob, SubmitJob, Task

HUGE = 10**12


def test_lookups_in_an_order_past_the_bound_are_refused_before_it_is_computed(router, client_for, make_token):
    tenant = client_for(router.endpoint, role="admin", token=make_token("admin", sub="tenant", datasets=["mnist"]))
    spec = {"dataset": "mnist", "model": "mlp", "epochs": 1, "batch_size": 16, "train_range": [0, HUGE]}
    job = tenant.request(SubmitJob(spec=spec)).job
    # an epoch's range: 10 positions, but of an order of 10^12 samples (8 TB computed, unbounded)
    with pytest.raises(BadRequest, match=f"order is over {HUGE} samples.*at most {history.MAX_ORDER_SAMPLES}"):
        tenant.request(GetJobSamples(job=job, epoch=0, start=0, stop=10))
    # a step's samples, and a skip of steps, once a trainer took the job (its attempt's segment recorded)
    trainer = client_for(router.endpoint, role="trainer", token=make_token("trainer", sub="gpu1"))
    assert isinstance(trainer.request(GetTask(key="k")), Task)
    with pytest.raises(BadRequest, match=f"order is over {HUGE} samples"):
        tenant.request(GetJobSamples(job=job, step=1))
    with pytest.raises(BadRequest, match=f"order is over {HUGE} samples"):
        tenant.request(SkipJob(job=job, steps=[[1, 2]]))
    # the bound itself is looked up as before, and the router answers the next ask
    small = {**spec, "train_range": [0, 1000]}
    assert len(history.epoch_range(JobSpec.from_dict(small), 0, 0, 10, n=1000)) == 10
    assert job in [j["id"] for j in tenant.request(ListJobs()).jobs]


def test_a_step_of_more_samples_than_a_reply_holds_is_refused_before_it_is_looked_up(router, client_for, make_token):
    tenant = client_for(router.endpoint, role="admin", token=make_token("admin", sub="tenant", datasets=["mnist"]))
    spec = {"dataset": "mnist", "model": "mlp", "epochs": 1, "batch_size": 1_000_000, "train_range": [0, 2_000_000]}
    job = tenant.request(SubmitJob(spec=spec)).job
    trainer = client_for(router.endpoint, role="trainer", token=make_token("trainer", sub="gpu1"))
    assert isinstance(trainer.request(GetTask(key="k")), Task)
    # a million indices would not encode in one reply (the router failed it as an internal error)
    for rank in (-1, 0):
        with pytest.raises(BadRequest, match=f"holds 1000000 samples.*at most {history.MAX_RANGE}"):
            tenant.request(GetJobSamples(job=job, step=1, rank=rank))
    assert job in [j["id"] for j in tenant.request(ListJobs()).jobs]
