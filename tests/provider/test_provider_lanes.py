"""A provider reads each dataset on lanes of its own (services/provider/fillers.py): a remote store
whose answers are outstanding holds up no other dataset and no other request, the GETs of a batch's
``x`` and ``y`` files go out side by side, and several batches of one remote dataset are read at once.

The store here is the suite's range server with its answers *held* (no byte sent until the test
releases them), so every check is an order of events, never a timing: what must be answered while
the store is silent is answered while it is silent, and what must go out together is in flight at once.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from libbus.errors import Unavailable
from libbus.wire.messages import BatchRequest, DatasetInfo, DatasetInfoRequest, Goodbye
from services.provider import fillers
from tests.support import scrape, value
from tests.support.held_store import (  # noqa: F401 - server_fixture: the `server` fixture
    LIVENESS,
    SLOW,
    WAIT_S,
    batch,
    every_batch_answered,
    in_flight,
    npy_pair,
    server_fixture,
    wait_until,
)


def test_a_silent_store_holds_up_no_other_dataset_and_its_batches_overlap(tmp_path, server, start_provider, client_for):
    remote_x, remote_y = npy_pair(tmp_path / "remote", 64, 1)
    local_x, local_y = npy_pair(tmp_path / "local", 32, 2)
    provider = start_provider(
        f"web={server.url}/remote/?{SLOW}",
        f"disk=file://{tmp_path / 'local'}?memory=ram&val_fraction=0",
        heartbeat_liveness=LIVENESS,
    )
    slow, fast = client_for(provider.endpoint, timeout_s=WAIT_S), client_for(provider.endpoint, timeout_s=WAIT_S)
    slow.hello(), fast.hello()

    server.hold()
    opened = len(server.gets())  # the headers read when the dataset opened
    first, second = np.array([5, 1, 2], "<i8"), np.array([60, 40], "<i8")
    asked = [slow.send(BatchRequest(dataset="web", split="train", frames=[first.tobytes()]))]
    in_flight(server, 2)  # one batch: its x and its y requested together, neither answered yet
    assert sorted(p for p, _ in server.gets()[opened:]) == ["/remote/train_x.npy", "/remote/train_y.npy"]
    asked.append(slow.send(BatchRequest(dataset="web", split="train", frames=[second.tobytes()])))
    in_flight(server, 4)  # the next batch of the same dataset is read beside it, not after it

    # the store is silent; the provider answers everything else meanwhile
    info = fast.request(DatasetInfoRequest(dataset="web"))
    assert isinstance(info, DatasetInfo) and info.info["splits"]["train"]["num_samples"] == 64
    idx = np.array([31, 0, 7], "<i8")
    x, y = batch(fast.request(BatchRequest(dataset="disk", split="train", frames=[idx.tobytes()])), 3)
    assert np.array_equal(x, local_x[idx]) and np.array_equal(y, local_y[idx])
    assert slow.recv(0) is None, "a remote batch was answered while its store had answered nothing"

    server.release()
    # read side by side, the two batches may be answered in either order
    every_batch_answered(slow, asked, [first, second], remote_x, remote_y)


def test_a_batch_that_fails_at_the_store_fails_alone(tmp_path, server, start_provider, client_for):
    """A GET that dies fails its own batch (UNAVAILABLE, naming the file); the next batch of the same
    dataset, and the lane it is read on, are unharmed."""
    remote_x, _ = npy_pair(tmp_path / "remote", 64, 3)
    provider = start_provider(
        f"web={server.url}/remote/?{SLOW}&ram_cache=65536&block=512", metrics_bind="127.0.0.1:0", name="prov-r"
    )
    client = client_for(provider.endpoint, timeout_s=WAIT_S)
    server.drops = 1  # the next range GET is hung up on
    with pytest.raises(Unavailable, match="remote/train_[xy].npy"):
        client.request(BatchRequest(dataset="web", split="train", frames=[np.array([3], "<i8").tobytes()]))
    x, _ = batch(client.request(BatchRequest(dataset="web", split="train", frames=[np.array([9], "<i8").tobytes()])), 1)
    assert np.array_equal(x, remote_x[[9]])
    fetched = provider.service.handler.stats()["remote_reads"]["web"]
    again, _ = batch(
        client.request(BatchRequest(dataset="web", split="train", frames=[np.array([9], "<i8").tobytes()])), 1
    )
    assert np.array_equal(again, x)
    # what an operator sees of it: the requests' limit, and the RAM cache's blocks: sample 9's x and y
    # blocks, fetched for the first read, come from RAM for the second
    me = dict(service="provider", name="prov-r", dataset="web")
    s = scrape(provider.service.metrics.url)
    assert value(s, "batchbus_remote_requests_limit", **me) >= 1
    assert value(s, "batchbus_ram_cache_fetches_total", **me) == fetched["ram_cache_fetches"]
    assert value(s, "batchbus_ram_cache_hits_total", **me) == fetched["ram_cache_hits"] + 2
    assert value(s, "batchbus_ram_cache_bytes", **me) == fetched["ram_cache_bytes"] > 0


def test_the_waiting_batches_of_a_session_that_ended_are_not_read(tmp_path, server, start_provider, client_for):
    """A loader that closes with batches still waiting in its dataset's lane costs the store nothing more:
    the batch being read finishes, the ones behind it are dropped (nobody would take them)."""
    npy_pair(tmp_path / "remote", 64, 6)
    provider = start_provider(f"web={server.url}/remote/?{SLOW}", remote_reads=1, heartbeat_liveness=LIVENESS)
    client = client_for(provider.endpoint, timeout_s=WAIT_S)
    client.hello()
    server.hold()
    opened = len(server.gets())
    for idx in ([1, 2], [30, 31], [50, 51]):
        client.send(BatchRequest(dataset="web", split="train", frames=[np.array(idx, "<i8").tobytes()]))
    in_flight(server, 2)  # the first batch's x and y; the other two wait in the lane
    client.send(Goodbye())
    deadline = time.monotonic() + WAIT_S
    while provider.service.server.stats()["sessions"]:
        assert time.monotonic() < deadline, "the session never ended"
        time.sleep(0.01)
    server.release()
    while provider.service.server._pending:  # the three batches, answered (to nobody) or dropped
        assert time.monotonic() < deadline, "the lane never emptied"
        time.sleep(0.01)
    assert len(server.gets()) - opened == 2, server.gets()[opened:]


def test_each_dataset_reads_on_lanes_of_its_own(tmp_path, server):
    """Which lane a batch is read on: remote datasets off the loop, on threads of their own dataset;
    sources whose reads share state on one serial lane for all of them; generated data on its dataset's
    fill lane; local gathers on the loop unless ring fills have threads."""
    from services.provider.sources import open_source

    npy_pair(tmp_path / "a", 8, 4)
    npy_pair(tmp_path / "b", 8, 5)
    a, b = open_source(f"{server.url}/a/?{SLOW}"), open_source(f"{server.url}/b/?{SLOW}")
    local = open_source(f"file://{tmp_path / 'a'}?memory=ram&val_fraction=0")
    lanes = fillers.Fillers(fill_thread=False, fill_threads=2, remote_reads=3)
    try:
        assert a.remote and b.remote and not local.remote
        assert lanes.for_batch("a", a, None) is lanes.for_batch("a", a, None) is not lanes.for_batch("b", b, None)
        assert lanes.for_batch("disk", local, None) is lanes.loop
        assert lanes.lanes() == {"a": {"remote": 3}, "b": {"remote": 3}}
        shared_a, shared_b = open_source("dummy://?shape=2&n=8"), open_source("dummy://?shape=3&n=8")
        assert lanes.for_batch("z1", shared_a, None) is lanes.for_batch("z2", shared_b, None) is not lanes.loop
        mock = open_source("mock://mnist?n=64")  # generated: off the loop, socket or ring alike
        assert lanes.for_batch("m", mock, None) is not lanes.loop
        assert lanes.lanes() == {"a": {"remote": 3}, "b": {"remote": 3}, "*": {"serial": 1}, "m": {"fill": 2}}
        threaded = fillers.Fillers(fill_thread=True, fill_threads=2)
        ring = object()  # a ring slot's destination: only whether there is one matters here
        assert threaded.for_batch("disk", local, ring) is not threaded.loop  # type: ignore[arg-type]
        assert threaded.for_batch("disk", local, None) is threaded.loop
        assert threaded.lanes() == {"disk": {"fill": 2}}
        threaded.close()
    finally:
        lanes.close()
        for s in (a, b, local):
            s.close()
