"""Which samples made step k: derived from the job's order and the segments of its attempts,
checked against what the trainers' audits recorded, for a job killed, resumed and resized; refusals of
malformed queries in one line, never a traceback."""

from __future__ import annotations

import json
import signal
import subprocess
from collections import Counter
from pathlib import Path

import orjson
import pytest

from libbus.errors import BadRequest, Forbidden, NotFound
from libbus.jobs.spec import JobSpec
from libbus.order import Order, elastic, epoch_order, history
from libbus.wire.messages import GetJob, GetJobSamples, SkipJob, SubmitJob
from tests.support.jobs import SPEC, JobCluster, wait_trained

#: The job tests' spec, typed as the router reads it from its store.
TYPED = JobSpec.from_dict(SPEC)


# -- the pure function ----------------------------------------------------------------------------
def test_a_resumed_segment_continues_the_cursor_at_its_world_size():
    spec = JobSpec.from_dict({**SPEC, "epochs": 3})
    gang = Order(n=600, seed=5, shuffle="full", rank=0, world_size=2, batch_size=16, drop_uneven=True)
    segments = [
        {"step": 0, "cursor": None, "world_size": 2, "batch_size": 16},
        {"step": 10, "cursor": elastic.state(gang, 0, 160, None), "world_size": 1, "batch_size": 16},
    ]
    whole = epoch_order(600, epoch=0, seed=5, shuffle="full")
    # a gang of 2: rank r's step k is the k-th batch of its half of epoch 0
    first = history.step_samples(spec, segments, 1, n=600)
    assert [e["indices"] for e in first] == [whole[:16].tolist(), whole[300:316].tolist()]
    # resumed alone from step 10 (both ranks 160 samples in): what is left of both halves, in order
    resumed = history.step_samples(spec, segments, 11, n=600)
    assert resumed == [
        {
            "rank": 0,
            "world_size": 1,
            "segment_step": 10,
            "epoch": 0,
            "position": 0,
            "indices": whole[160:176].tolist(),
        }
    ]
    # every sample of epoch 0 exactly once over the steps the job takes
    seen = [i for k in range(1, 11) for e in history.step_samples(spec, segments, k, n=600) for i in e["indices"]]
    k = 11
    while (e := history.step_samples(spec, segments, k, n=600)[0])["epoch"] == 0:
        seen += e["indices"]
        k += 1
    assert sorted(seen) == list(range(600))
    assert e["epoch"] == 1 and e["position"] == 0  # then epoch 1, whole, from its start
    assert history.step_samples(spec, segments, 10**6, n=600)[0]["indices"] == []  # past the last epoch


@pytest.mark.parametrize(
    ("step", "rank", "error", "match"),
    [
        (0, None, BadRequest, "steps count from 1"),
        (-3, None, BadRequest, "steps count from 1"),
        (5, 2, BadRequest, "rank 2 is outside the world of 2"),
    ],
)
def test_malformed_step_queries_are_refused(step, rank, error, match):
    segments = [{"step": 0, "cursor": None, "world_size": 2, "batch_size": 16}]
    with pytest.raises(error, match=match):
        history.step_samples(TYPED, segments, step, n=600, rank=rank)


def test_a_step_before_any_segment_is_not_found():
    with pytest.raises(NotFound, match="no recorded attempt"):
        history.step_samples(TYPED, [], 1, n=600)
    with pytest.raises(NotFound, match="before the oldest segment kept"):
        history.step_samples(TYPED, [{"step": 40, "cursor": None, "world_size": 1}], 3, n=600)
    with pytest.raises(BadRequest, match="at most"):
        history.epoch_range(TYPED, 0, 0, history.MAX_RANGE + 1, n=10**6)
    with pytest.raises(BadRequest, match="within 0:600"):
        history.epoch_range(TYPED, 0, 5, 601, n=600)


# -- a real job: killed, resumed at another world size ---------------------------------------------
@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """A router and a provider of mock://mnist?n=600 that the kill-and-resize tests share: each starts
    trainers of its own (:func:`own_trainers` stops them when it ends: none joins the next test's gang)."""
    cluster = JobCluster(tmp_path_factory.mktemp("steps"))
    try:
        cluster.start_router()
        cluster.start_provider()
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def by_digest(jobs) -> dict[str, int]:
    """The train split's sample index of each digest (what the audits record)."""
    return jobs.index_of_digest()


@pytest.fixture
def own_trainers(jobs):
    """Names of the trainers a test starts on :func:`jobs`: stopped (SIGTERM) when it ends, pass or fail."""
    names: list[str] = []
    yield names
    procs = [jobs.procs[n] for n in names if n in jobs.procs]
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _audited_steps(directory: Path, job: str) -> dict[tuple[int, int], list[str]]:
    """``(step, rank) -> digests`` the job's final model was trained on: an attempt's steps after
    the step a later attempt resumed from are cut (as services/trainer/attempt/audit.py's effective_epochs)."""
    attempts = []
    for path in directory.glob(f"{job}.*.jsonl"):
        lines = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
        if lines:
            head, records = lines[0], lines[1:]
            ended = max([head["started"], *(b["t"] for b in records)])
            attempts.append((head["started"], ended, head["rank"], int(head["resumed_from_step"]), records))
    out = {}
    for started, ended, rank, _, records in attempts:
        cut = min((s for t, _, r, s, _ in attempts if t > started and (r == rank or t > ended)), default=None)
        for b in records:
            if cut is None or b["step"] <= cut:
                out[(b["step"], rank)] = b["samples"]
    return out


@pytest.mark.timeout(300)  # its own waits allow more than the suite's default 120 s
def test_samples_of_every_step_are_what_the_audit_recorded_across_a_kill_and_a_resize(jobs, by_digest, own_trainers):
    cluster = jobs
    own_trainers += ["s1", "s2"]
    for name in own_trainers:
        cluster.start_trainer(name)
    cluster.wait_connected(("s1", "s2"))
    spec = {**SPEC, "epochs": 2, "elastic": True, "min_world_size": 1, "max_world_size": 2}
    job = cluster.submit_spec({**spec, "gather_timeout_s": 5.0})
    info = cluster.wait(job, lambda i: i["state"] == "running", timeout=90)
    assert len(info["gang"]["members"]) == 2, info["events"]
    wait_trained(cluster, job, SPEC["checkpoint_every"] + 1, ranks=2)  # past the first checkpoint, each rank
    cluster.procs[info["gang"]["members"][1]].kill()  # rank 0's next collective breaks: resumed alone
    info = cluster.wait_end(job, timeout=120)
    assert info["state"] == "succeeded", f"{info['error']}; logs in {cluster.state}"
    assert info["result"]["world_size"] == 1 and info["progress"]["resumed_from"]["step"] >= 1

    audited = _audited_steps(cluster.audit, job)
    worlds = Counter()
    for (step, rank), digests in sorted(audited.items()):
        reply = cluster.admin.request(GetJobSamples(job=job, step=step, rank=rank))
        [entry] = reply.samples
        assert entry["indices"] == [by_digest[d] for d in digests], f"step {step} rank {rank}"
        worlds[entry["world_size"]] += 1
    assert worlds[2] >= 2 and worlds[1] >= 2, worlds  # steps of both segments were checked

    # the CLI: one step, every rank, as JSON and as text; an epoch's range
    step = max(s for s, _ in audited)
    out = json.loads(cluster.busctl("job", "samples", job, "--step", str(step), "--json").stdout)
    assert out["samples"][0]["indices"] == [by_digest[d] for d in audited[(step, 0)]]
    text = cluster.busctl("job", "samples", job, "--step", "1").stdout
    assert text.count("rank ") == 2 and "/2 (epoch 0 position 0)" in text, text
    out = json.loads(cluster.busctl("job", "samples", job, "--epoch", "1", "--range", "0:5", "--json").stdout)
    assert out["samples"][0]["indices"] == epoch_order(600, epoch=1, seed=5, shuffle="full")[:5].tolist()

    # refusals: one line on stderr, no traceback
    for args, says in [
        (("--step", "0"), "counted from 1"),
        (("--step", "3", "--rank", "7"), "rank 7 is outside"),
        (("--epoch", "0", "--range", "9:2"), "0 <= A < B"),
        (("--epoch", "0", "--range", "x"), "is not A:B"),
        (("--epoch", "0", "--range", "0:999"), "within 0:600"),
        ((), "give --step K"),
    ]:
        bad = cluster.busctl("job", "samples", job, *args, check=False)
        assert bad.returncode != 0 and "Traceback" not in bad.stdout + bad.stderr, bad.stderr
        assert says in bad.stderr, (args, bad.stderr)
    bad = cluster.busctl("job", "samples", "jnothere", "--step", "1", check=False)
    assert bad.returncode != 0 and "no job" in bad.stderr and "Traceback" not in bad.stderr


# -- skipping a stretch ----------------------------------------------------------------------------
def _samples(cluster: JobCluster, job: str, step: int) -> list[dict]:
    return cluster.admin.request(GetJobSamples(job=job, step=step)).samples


# four epochs, a pause, a skip, a kill and six busctl processes: minutes on a loaded machine (its own
# waits bound each stage; the suite's 120 s would cut it in its last busctl calls)
@pytest.mark.timeout(300)
def test_a_skipped_stretch_is_never_trained_again_across_a_kill_and_a_resize(jobs, by_digest, own_trainers):
    cluster = jobs
    own_trainers += ["k1", "k2"]
    for name in own_trainers:
        cluster.start_trainer(name)
    cluster.wait_connected(("k1", "k2"))
    spec = {**SPEC, "epochs": 4, "checkpoint_every": 4, "elastic": True, "min_world_size": 1}
    job = cluster.submit_spec({**spec, "max_world_size": 2, "gather_timeout_s": 5.0})
    cluster.wait(job, lambda i: i["state"] == "running" and (i["progress"] or {}).get("step", 0) >= 6, 90)
    cluster.control(job, "pause")  # a fixed place to skip from (the trainer pauses between batches)
    info = cluster.job(job)
    assert info["state"] == "paused" and len(info["gang"]["members"]) == 2, info["events"]
    now, last = info["progress"]["step"], info["checkpoint"]["step"]
    # steps after the last checkpoint up to the one trained last, within that checkpoint's epoch
    a = last + 1
    epoch = _samples(cluster, job, a)[0]["epoch"]
    b = a + 1
    while b <= max(now, a + 1) and _samples(cluster, job, b)[0]["epoch"] == epoch:
        b += 1
    stretch = {i for k in range(a, b) for e in _samples(cluster, job, k) for i in e["indices"]}
    assert len(stretch) == 32 * (b - a)

    out = cluster.busctl("job", "skip", job, "--steps", f"{a}:{b}").stdout
    assert f"skips {len(stretch)} sample(s)" in out and f"rewinds to the checkpoint of step {last}" in out, out
    shown = cluster.busctl("job", "show", job).stdout
    assert "skipped: " in shown and "skip=[[" in shown, shown
    cluster.control(job, "resume")  # paused with no trainer: queued, and the gang gathers again
    cluster.wait(
        job,
        lambda i: (
            i["state"] == "running"
            and ((i["progress"] or {}).get("resumed_from") or {}).get("step") == last
            and (i["progress"] or {}).get("checkpoint_step", 0) > last
        ),
        90,
    )
    members = cluster.job(job)["gang"]["members"]
    # SIGKILL: a gang of 2 resumes on the one trainer left; a gang of 1 (the other trainer was
    # still leaving the abandoned attempt when it gathered: resized already) on the other trainer
    cluster.procs[members[-1]].kill()
    info = cluster.wait_end(job, timeout=180)
    assert info["state"] == "succeeded", f"{info['error']}; logs in {cluster.state}"
    assert info["result"]["world_size"] == 1

    from services.trainer.attempt.audit import effective_epochs

    everything = Counter(range(600))
    for e, digests in sorted(effective_epochs(cluster.audit, job).items()):
        seen = Counter(by_digest[d] for d in digests)
        want = everything if e < epoch else Counter(set(range(600)) - stretch)
        assert seen == want, (
            f"epoch {e}: {sorted((seen - want).elements())[:10]} extra, {sorted((want - seen).elements())[:10]} missing"
        )
    assert len(effective_epochs(cluster.audit, job)) == 4
    # the stretch's steps now name other samples: those the job trained there after the rewind
    again = {i for e in _samples(cluster, job, a) for i in e["indices"]}
    assert again and not again & stretch

    # refusals: one line, no traceback
    for args, says in [
        (("--steps", "5:2"), "0 <= A < B"),
        (("--steps", "x"), "is not A:B"),
        ((), "give --steps"),
    ]:
        bad = cluster.busctl("job", "skip", job, *args, check=False)
        assert bad.returncode != 0 and "Traceback" not in bad.stdout + bad.stderr, bad.stderr
        assert says in bad.stderr, (args, bad.stderr)
    bad = cluster.busctl("job", "skip", job, "--steps", "1:2", check=False)
    assert "already succeeded" in bad.stderr


def test_skips_and_sample_queries_that_are_malformed_huge_or_out_of_scope_are_refused(router, client_for, make_token):
    admin = client_for(router.endpoint, role="admin")
    job = admin.request(SubmitJob(spec={**SPEC, "train_range": [100, 400]})).job
    scoped = client_for(router.endpoint, role="admin", token=make_token("admin", sub="ops-cifar", datasets=["cifar10"]))
    for msg in (SkipJob(job=job, samples=[[100, 110]]), GetJobSamples(job=job, step=1)):
        with pytest.raises(Forbidden, match="'mnist' is outside this token's datasets scope"):
            scoped.request(msg)
    refused = [
        (SkipJob(job=job), "skip needs steps"),
        (SkipJob(job=job, samples=[[5, 2]]), "is not \\[a, b\\] with 0 <= a < b"),
        (SkipJob(job=job, samples=[[0, 10]]), "outside the job's 100:400"),
        (SkipJob(job=job, samples=[[390, 401]]), "outside the job's 100:400"),
        (SkipJob(job=job, samples=[["a", 3]]), "is not \\[a, b\\]"),
        (SkipJob(job=job, steps=[[0, 3]]), "1 <= a < b"),
        (SkipJob(job=job, steps=[[1, 10**9]]), "at most 10000 at once"),
        (SkipJob(job=job, samples=[[i, i + 1] for i in range(0, 10000, 2)]), "at most 4096"),
        (SkipJob(job=job, steps=[[1, 3]]), "no recorded attempt"),  # queued: no step has an order yet
        (GetJobSamples(job=job, step=0), "counted from 1"),
        (GetJobSamples(job=job, epoch=0, start=0, stop=301), "within 0:300"),
    ]
    for msg, says in refused:
        with pytest.raises((BadRequest, NotFound), match=says):
            admin.request(msg)
    # many skips, each within bounds, until their ranges reach the bound: the next is refused
    hundred = [[100 + 2 * j, 101 + 2 * j] for j in range(100)]  # 100 ranges
    for _ in range(40):
        admin.request(SkipJob(job=job, samples=hundred))
    with pytest.raises(BadRequest, match="more than 4096 index ranges"):
        admin.request(SkipJob(job=job, samples=hundred))
    spec = admin.request(GetJob(job=job)).job["spec"]
    assert len(spec["skip"]) == 40 and sum(len(s) for s in spec["skip"]) <= 4096
    assert not spec.get("spike")  # an admin's skips leave the job's own spike skipping off
    # with no provider online and no checkpoint, the train_range gives the order's size; a range of an
    # epoch's whole order is in the split's indices (the range's first added)
    reply = admin.request(GetJobSamples(job=job, epoch=0, start=0, stop=5))
    assert reply.n == 300 and all(100 <= i < 400 for i in reply.samples[0]["indices"])


def _one_skip(rnd, n: int) -> tuple[tuple[int, int], ...]:
    a = rnd.randrange(n)
    return ((a, min(n, a + rnd.randint(1, 20))),)


def test_a_skip_leaves_an_order_exactly_once_across_resumes_at_any_world_size():
    """Random orders, skips and world sizes: a cursor saved under some skips and restored under one
    more reads every sample it had not read and is not skipped exactly once, and no skipped one."""
    import random

    from libbus.order.epochs import skip_ranges

    for seed in range(300):
        rnd = random.Random(seed)
        n, w, w2, b = rnd.randint(1, 200), rnd.randint(1, 4), rnd.randint(1, 4), rnd.randint(1, 9)
        shuffle = rnd.choice(["full", "none", "block"])
        uneven = w > 1 and rnd.random() < 0.5
        uneven2 = uneven if w2 == w else w2 > 1 and rnd.random() < 0.5

        before = tuple(_one_skip(rnd, n) for _ in range(rnd.randint(0, 2)))
        after = (*before, _one_skip(rnd, n))
        kw = {"n": n, "seed": seed, "shuffle": shuffle, "block_size": 7, "batch_size": b}
        olds = [Order(**kw, rank=r, world_size=w, drop_uneven=uneven, skip=before) for r in range(w)]
        k = rnd.randint(0, olds[0].num_batches())
        read, states = [], []
        for o in olds:
            done = o.batches(0)[:k]
            read += [int(i) for x in done for i in x]
            states.append(elastic.state(o, 0, sum(len(x) for x in done), None))
        rest = []
        for r in range(w2):
            o = Order(**kw, rank=r, world_size=w2, drop_uneven=uneven2, skip=after)
            epoch, position, plan = elastic.restore(o, states[0] if rnd.random() < 0.5 else states)
            if epoch == 0:
                rest += [int(i) for i in elastic.indices(o, 0, plan)[position:]]
        skipped = {i for a, z in skip_ranges(after) for i in range(a, z)}
        assert not set(read) & {i for a, z in skip_ranges(before) for i in range(a, z)}, seed
        assert not set(rest) & skipped, seed
        read += rest
        assert len(read) == len(set(read)), seed
        if not uneven and not uneven2:
            assert set(range(n)) - set(read) - skipped == set(), seed


@pytest.mark.timeout(300)  # its own waits allow more than the suite's default 120 s
def test_samples_of_an_entrypoint_jobs_steps_are_what_its_function_trained_on_across_a_kill(tmp_path):
    from tests.support.jobs import EntryCluster

    cluster = EntryCluster(tmp_path)
    out = tmp_path / "steps"
    out.mkdir()
    try:
        cluster.start_router()
        cluster.start_provider()
        by_digest = cluster.index_of_digest()
        job = cluster.submit_spec(
            {
                "dataset": "mnist",
                "entrypoint": "tests.support.entrypoints:recorded",
                "params": {"epochs": 2, "out": str(out)},
                "batch_size": 16,
                "shuffle": "block",
                "block_size": 24,
                "seed": 9,
                "evaluate": False,
                "checkpoint_every": 7,
                "train_range": [100, 420],  # the order is over 320 records from 100: indices are the split's
                "max_attempts": 5,
            }
        )
        killed = cluster.start_killed_at("k1", "entry_checkpoint")  # dies once its first checkpoint is in
        assert killed.wait(180) != 0, cluster.logs()
        cluster.start_trainer("k1")  # restarted under its name: the job is given back at once, not after its lease
        info = cluster.wait_end(job, timeout=180)
        assert info["state"] == "succeeded", f"{info['error']}; logs in {cluster.state}"

        attempts = {}
        for path in sorted(out.glob("*.jsonl")):
            lines = [json.loads(line) for line in path.read_text().splitlines()]
            attempts[int(path.stem)] = (lines[0]["resumed_from_step"], lines[1:])
        assert len(attempts) == 2 and attempts[1][0] == 7, attempts.keys()
        checked = 0
        for attempt, (_, steps) in attempts.items():
            cut = min((s for a, (s, _) in attempts.items() if a > attempt), default=None)
            for rec in steps:
                if cut is None or rec["step"] <= cut:
                    [entry] = cluster.admin.request(GetJobSamples(job=job, step=rec["step"])).samples
                    assert entry["indices"] == [by_digest[d] for d in rec["samples"]], f"step {rec['step']}"
                    checked += 1
        assert checked == 40  # 2 epochs of 20 steps, each checked once
    finally:
        cluster.close()


# -- a script's loader ----------------------------------------------------------------------------
@pytest.fixture
def ids(start_provider, tmp_path_factory):
    """Train sample i holds i in its first feature (48 of them)."""
    import numpy as np

    d = tmp_path_factory.mktemp("ids")
    for split, n in (("train", 48), ("val", 6), ("test", 5)):
        i = np.arange(n)
        np.save(d / f"{split}_x.npy", np.stack([i, i % 3], axis=1).astype(np.float32))
        np.save(d / f"{split}_y.npy", (i % 2).astype(np.int64))
    return start_provider(f"ids=file://{d}")


def test_a_scripts_loader_takes_the_skips_and_resumes_under_one_more(ids, make_token):
    from libbus import RemoteLoader

    def loader(**kw):
        return RemoteLoader("ids", provider=ids.endpoint, token=make_token("trainer"), seed=3, batch_size=5, **kw)

    def read(batches):
        return [int(v) for x, _ in batches for v in x[:, 0]]

    with loader(samples=(8, 40), skip=[[[10, 14]], [[0, 9], [39, 60]]]) as ld:
        assert len(ld) == 6  # 32 records, 26 of them kept: 6 batches
        assert sorted(read(ld)) == [*range(9, 10), *range(14, 39)]
        it = iter(ld)
        first = read([next(it), next(it)])
        state = ld.state_dict()
    assert state["skips"] == 2
    more = [[[10, 14]], [[0, 9], [39, 60]], [[20, 30]]]
    rest = set()
    for rank in (0, 1):  # resumed under one more skip, by two ranks
        with loader(samples=(8, 40), skip=more, rank=rank, world_size=2, drop_uneven=False) as ld:
            ld.load_state_dict(state)
            rest |= set(read(ld))
    assert not rest & set(first) and not rest & set(range(20, 30))
    assert set(first) | rest == {9, *range(14, 39)} - (set(range(20, 30)) - set(first))
    with (
        pytest.raises(BadRequest, match="not the first of this loader's"),
        loader(samples=(8, 40), skip=more[1:]) as ld,
    ):
        ld.load_state_dict(state)
    with pytest.raises(BadRequest, match="0 <= start < stop"):
        loader(skip=[[[5, 5]]])
