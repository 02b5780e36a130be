"""A skip's work is bounded before it starts: ``busctl job skip --samples`` ranges are merged by their
bounds (a range of tens of millions of samples costs what a range of one does), the ranges a job's
skips may hold are counted before anything is stored, and the samples of skipped steps are looked up
with each epoch's order computed once and refused past ``MAX_STEP_SAMPLES``. The router answers the
next admin's ``ListJobs`` as it did before.
"""

from __future__ import annotations

import pytest

from libbus.errors import BadRequest
from libbus.jobs.spec import JobSpec
from libbus.order import history
from libbus.wire.messages import GetJob, ListJobs, SkipJob, SubmitJob

SPEC = {"dataset": "mnist", "model": "mlp", "epochs": 1, "batch_size": 16, "evaluate": False}
#: An order of 40 million samples (a train_range: no provider needed to know its size).
N = 40_000_000


def test_huge_sample_ranges_are_merged_by_their_bounds_and_the_router_serves_on(router, client_for):
    admin = client_for(router.endpoint, role="admin")
    job = admin.request(SubmitJob(spec={**SPEC, "train_range": [0, N]})).job
    # overlapping, unsorted, touching: one range of N - 1 samples (index 7 kept); expanded index by
    # index, this was ~100 s of the router's loop and gigabytes (the client gives up after 3 s)
    done = admin.request(SkipJob(job=job, samples=[[8, N // 2], [0, 7], [N // 4, N], [N // 2, N // 2 + 5]]))
    assert done.detail["skipped"] == N - 1 and done.detail["ranges"] == 2
    assert admin.request(GetJob(job=job)).job["spec"]["skip"] == [[[0, 7], [8, N]]]
    # a message of 4,096 ranges more: past what a job's skips hold in all, refused before it is stored
    many = [[7 + k, 8 + k] for k in range(0, 2 * 4096, 2)]
    with pytest.raises(
        BadRequest, match=r"more than 4096 index ranges in all \(this skip is 4096, job \w+'s skips hold 2\)"
    ):
        admin.request(SkipJob(job=job, samples=many))
    assert len(admin.request(GetJob(job=job)).job["spec"]["skip"]) == 1
    assert job in [j["id"] for j in admin.request(ListJobs()).jobs]  # another ask, answered


def test_ranges_are_united_by_their_bounds():
    assert history.union_ranges([[5, 10], [0, 3]], [[3, 4], [9, 12], [20, 21]]) == [[0, 4], [5, 12], [20, 21]]
    assert history.union_ranges([[0, 10**15]], [[10, 20]]) == [[0, 10**15]]
    assert history.union_ranges([], []) == []


def test_the_samples_of_many_steps_are_looked_up_with_each_epoch_computed_once():
    spec = JobSpec.from_dict({**SPEC, "epochs": 50, "shuffle": "full", "seed": 3, "batch_size": 7})
    segments = [{"step": 0, "world_size": 2, "batch_size": 7, "cursor": None}]
    memo: dict = {}
    shared = [history.step_samples(spec, segments, k, n=100, memo=memo) for k in range(1, 300)]
    alone = [history.step_samples(spec, segments, k, n=100) for k in range(1, 300)]
    assert shared == alone  # the memo changes the cost, never the answer
