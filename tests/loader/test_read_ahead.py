"""Read-ahead of the known order: a loader tells its provider the samples it will ask for next
(``ReadAhead``), and a remote dataset's RAM cache fetches the blocks they lie in before they are asked
for; a new plan replaces the last (blocks not yet started are never fetched), and the batches of the
plan then come from RAM. The store's answers are held where an order of events must be shown, so no
check is a timing."""

from __future__ import annotations

import numpy as np
import pytest

from libbus.errors import SplitPrivate
from libbus.loader.remote import RemoteLoader
from libbus.wire.messages import BatchRequest, ReadAhead
from tests.support.held_store import (  # noqa: F401 - server_fixture: the `server` fixture
    LIVENESS,
    SLOW,
    WAIT_S,
    npy_pair,
    server_fixture,
    wait_until,
)


def ahead(dataset: str, indices, split: str = "train") -> ReadAhead:
    return ReadAhead(dataset=dataset, split=split, frames=[np.asarray(indices, "<i8").tobytes()])


def test_a_plan_is_fetched_before_it_is_asked_for_and_a_new_one_replaces_it(
    tmp_path, server, start_provider, client_for
):
    x, y = npy_pair(tmp_path / "remote", 200, 1)
    # one request in flight for the dataset (held: not climbed), so read-ahead takes one block at a time
    query = "val_fraction=0&concurrency=1&block=512&ram_cache=1000000&retries=0&timeout=120"
    # a silent client's session lasts while the store is held (the tests' default: 1 s of silence)
    provider = start_provider(f"web={server.url}/remote/?{query}", heartbeat_liveness=LIVENESS)
    memory = provider.service.handler.datasets["web"].location.client.memory
    client = client_for(provider.endpoint, timeout_s=WAIT_S)
    client.hello()

    server.hold()
    opened = len(server.gets())
    first = client.request(ahead("web", range(0, 60)))
    assert first.detail["blocks"] > 2
    wait_until(lambda: server.inflight == 1, "the plan's first block was never asked for")
    second = client.request(ahead("web", range(150, 170)))  # a seek: this plan replaces the first
    planned = second.detail["blocks"]
    server.release()
    wait_until(lambda: memory.stats()["ram_cache_ahead"] == 0, "the plan was never fetched")
    fetched = server.gets()[opened:]
    assert len(fetched) == 1 + planned, fetched  # the first plan's block under way, then the second plan's

    before = len(server.gets())
    idx = np.arange(150, 170)
    reply = client.request(BatchRequest.for_indices(idx, dataset="web", split="train"))
    got_x = np.frombuffer(reply.frames[0].buffer, reply.dtypes[0]).reshape(reply.shapes[0])
    got_y = np.frombuffer(reply.frames[1].buffer, reply.dtypes[1]).reshape(reply.shapes[1])
    assert np.array_equal(got_x, x[idx]) and np.array_equal(got_y, y[idx])
    assert len(server.gets()) == before, "a batch of the plan went to the store"

    # refused as a batch would be; a dataset with nothing to fetch ahead answers Ok with no blocks
    with pytest.raises(SplitPrivate):
        client.request(ahead("web", [0], split="test"))
    assert client.request(ahead("web", [])).detail["blocks"] == 0  # an empty plan cancels


def test_a_loader_sends_its_order_ahead_and_reads_it_from_ram(tmp_path, server, start_provider, make_token):
    x, _ = npy_pair(tmp_path / "remote", 512, 2)
    provider = start_provider(f"web={server.url}/remote/?val_fraction=0&block=4096&ram_cache=10000000")
    memory = provider.service.handler.datasets["web"].location.client.memory
    with RemoteLoader(
        "web", provider=provider.endpoint, token=make_token(), batch_size=16, shuffle="full", seed=3, inflight=2
    ) as loader:
        order = loader.order(0)
        seen = [xb.numpy().copy() for xb, _ in loader]
    assert np.array_equal(np.concatenate(seen), x[order])
    stats = memory.stats()
    assert stats["ram_cache_prefetched"] > 0  # the loader's plan fetched blocks before their batches asked
