"""RemoteLoader against a real provider: order, prefetch, and a provider that dies mid-request."""

import signal
import time

import numpy as np
import orjson
import pytest
import torch

from libbus.errors import BadRequest, PeerTimeout
from libbus.loader.remote import RemoteLoader
from libbus.order.epochs import epoch_order
from services.provider.sources import open_source
from tests.support import Cluster


def labels_of(loader) -> list[int]:
    return [int(v) for _, y in loader for v in y]


def test_loader_resolves_through_the_router_and_yields_tensors(router, provider, make_token):
    with RemoteLoader(
        "remote://mnist", router=router.endpoint, token=make_token(), batch_size=50, shuffle=False
    ) as loader:
        assert len(loader) == 12 and loader.provider == provider.endpoint
        # same host: tensors view a ring slot and are valid until the next batch, so copy them
        batches = [(x.clone(), y.clone()) for x, y in loader]
    assert all(isinstance(x, torch.Tensor) and x.dtype == torch.float32 for x, _ in batches)
    x = torch.cat([b[0] for b in batches])
    want, _ = open_source("mock://mnist?n=600").read("train", np.arange(600))
    assert np.array_equal(x.numpy(), want)


def test_shuffle_is_seeded_reproducible_and_new_each_epoch(provider, make_token):
    def run(seed, inflight):
        with RemoteLoader(
            "mnist", provider=provider.endpoint, token=make_token(), batch_size=64, seed=seed, inflight=inflight
        ) as loader:
            return labels_of(loader), labels_of(loader)  # two passes = epochs 0 and 1

    e0, e1 = run(7, 1)
    assert run(7, 6) == (e0, e1)  # prefetch depth does not change what is read
    assert e0 != e1 and run(8, 2)[0] != e0
    source = open_source("mock://mnist?n=600")
    assert e0 == source.labels("train", epoch_order(600, epoch=0, seed=7, shuffle=True)).tolist()


def test_shards_are_disjoint_and_cover_every_sample():
    parts = [epoch_order(1001, epoch=3, seed=1, shuffle=True, rank=r, world_size=4) for r in range(4)]
    joined = np.concatenate(parts)
    assert len(joined) == 1001 and np.array_equal(np.sort(joined), np.arange(1001))


def test_a_killed_provider_makes_the_loader_time_out_not_hang(router, make_settings, make_token, state_dir):
    cluster = Cluster(state_dir)
    proc = cluster.start(
        "provider",
        "provider",
        "--router",
        router.endpoint,
        "--dataset",
        "big=mock://cifar10?n=5000",
        ready=True,
        named=False,
    )
    try:
        endpoint = cluster.endpoint_of("provider")
        loader = RemoteLoader(
            "big",
            provider=endpoint,
            token=make_token(datasets=["big"]),
            batch_size=256,
            inflight=2,
            timeout_s=1.0,
            retries=2,
            provider_wait_s=2,
        )
        it = iter(loader)
        next(it)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        started = time.monotonic()
        with pytest.raises(PeerTimeout, match=r"no provider of big/train answered for 2 s \(provider_wait_s\)"):
            for _ in it:
                pass
        # a timeout, a reconnect that fails, then provider_wait_s; bounded, never a hang
        assert time.monotonic() - started < 20
        loader.close()
    finally:
        cluster.close(sig=signal.SIGKILL)


@pytest.mark.parametrize("shuffle", ["none", "full", "block"])
def test_a_restored_cursor_continues_at_the_exact_sample(provider, make_token, shuffle):
    kw = dict(provider=provider.endpoint, token=make_token(), batch_size=32, seed=5, shuffle=shuffle, block_size=50)
    with RemoteLoader("mnist", **kw) as loader:
        uninterrupted = [labels_of(loader), labels_of(loader)]  # epochs 0 and 1
    with RemoteLoader("mnist", **kw) as first:
        seen = []
        for i, (_, y) in enumerate(first):
            seen += y.tolist()
            if i == 6:
                break
        state = orjson.loads(orjson.dumps(first.state_dict()))  # as stored in a checkpoint
    assert state["epoch"] == 0 and state["position"] == 7 * 32
    with RemoteLoader("mnist", **kw) as resumed:
        resumed.load_state_dict(state)
        resumed.set_epoch(0)  # a training loop's call keeps it
        seen += labels_of(resumed)
        assert seen == uninterrupted[0] and labels_of(resumed) == uninterrupted[1]
    with RemoteLoader("mnist", **{**kw, "seed": 6}) as other, pytest.raises(BadRequest, match="seed"):
        other.load_state_dict(state)
