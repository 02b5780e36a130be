"""A remote dataset whose lane is saturated (its requests in flight at their limit, more of them waiting
for a place, the store answering none) holds up no one else on its provider: a new client's ``Hello``,
``DatasetInfo`` of either dataset and a local dataset's batch are answered meanwhile; and once the
store answers, every waiting request gets its place in turn, so each remote batch arrives whole. A
request waiting for its store's reply takes none of the few turns the readers have at the GIL.

The store's answers are held (tests/support/held_store.py), so each check is an order of events,
never a timing.
"""

from __future__ import annotations

import threading

import numpy as np

from libbus.wire.messages import BatchRequest, DatasetInfo, DatasetInfoRequest
from services.provider.sources.storage.httprange import PYTHON_TURNS, HttpSettings, RangeClient
from services.provider.sources.storage.inflight import InflightLimit
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
from tests.support.httpd import RangeServer

#: Two requests in flight at most for the remote dataset, and one GET per sample (``coalesce=0`` with
#: indices never adjacent): a batch of six samples is twelve GETs, ten of them waiting for a place.
SATURATED = "concurrency=2&max_concurrency=2&coalesce=0"


def test_a_saturated_remote_lane_holds_up_no_session_and_no_other_dataset(tmp_path, server, start_provider, client_for):
    remote_x, remote_y = npy_pair(tmp_path / "remote", 64, 1)
    local_x, local_y = npy_pair(tmp_path / "local", 32, 2)
    provider = start_provider(
        f"web={server.url}/remote/?{SLOW}&{SATURATED}",
        f"disk=file://{tmp_path / 'local'}?memory=ram&val_fraction=0",
        heartbeat_liveness=LIVENESS,
    )
    slow = client_for(provider.endpoint, timeout_s=WAIT_S)
    slow.hello()

    server.hold()
    opened = len(server.gets())  # the headers read when the dataset opened
    wanted = [np.array(i, "<i8") for i in ([60, 2, 40, 12, 30, 50], [9, 55, 21, 0, 33, 47], [17, 5, 62, 26, 44, 37])]
    asked = [slow.send(BatchRequest(dataset="web", split="train", frames=[idx.tobytes()])) for idx in wanted]
    in_flight(server, 2)  # the dataset's limit reached: every other GET of the three batches waits for a place
    assert len(server.gets()) - opened == 2, "more GETs went out than the dataset's limit allows"

    # a trainer that arrives now is welcomed and told what it asks, and the local dataset is read
    newcomer = client_for(provider.endpoint, timeout_s=WAIT_S)
    newcomer.hello()
    for name, n in (("web", 64), ("disk", 32)):
        info = newcomer.request(DatasetInfoRequest(dataset=name))
        assert isinstance(info, DatasetInfo) and info.info["splits"]["train"]["num_samples"] == n
    idx = np.array([31, 0, 7], "<i8")
    x, y = batch(newcomer.request(BatchRequest(dataset="disk", split="train", frames=[idx.tobytes()])), 3)
    assert np.array_equal(x, local_x[idx]) and np.array_equal(y, local_y[idx])
    assert slow.recv(0) is None, "a remote batch was answered while its store had answered nothing"
    assert len(server.gets()) - opened == 2, "the limit let more GETs out while none had been answered"

    server.release()
    every_batch_answered(slow, asked, wanted, remote_x, remote_y, ": a request never got its place")
    assert len(server.gets()) - opened == 2 * sum(len(i) for i in wanted)  # one GET per sample and file


def test_every_request_waiting_for_a_place_gets_one_and_no_more_than_the_limit_run_at_once():
    """A release wakes the first in line (not all of them), who wakes the next; none is left waiting,
    whether places come back one by one or the limit is halved by a throttled store on the way."""
    limit = InflightLimit(start=3, cap=3)
    lock, running, most, done = threading.Lock(), [0], [0], []
    gate = threading.Event()

    def request(i: int) -> None:
        assert limit.acquire(WAIT_S), f"request {i} never got a place"
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        gate.wait(WAIT_S)
        with lock:
            running[0] -= 1
            done.append(i)
        limit.release(1, throttled=i == 0)  # the first one back halves the limit

    threads = [threading.Thread(target=request, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    wait_until(lambda: limit.inflight == 3 and limit.waiting == 37, "three places taken, 37 requests waiting")
    gate.set()
    for t in threads:
        t.join(WAIT_S)
    assert sorted(done) == list(range(40)), "a request waiting for a place was never woken"
    assert most[0] == 3 and limit.inflight == 0 and limit.limit >= 1


def test_requests_waiting_on_a_silent_store_leave_other_readers_their_python_turns(tmp_path):
    """More requests outstanding at a silent store than there are Python turns
    (:data:`~services.provider.sources.storage.httprange.PYTHON_TURNS`): another dataset's reads from
    another store are answered meanwhile, and the silent store's all arrive whole once it answers."""
    npy_pair(tmp_path / "silent", 64, 3)
    npy_pair(tmp_path / "other", 64, 4)
    silent, other = RangeServer(tmp_path), RangeServer(tmp_path)
    settings = HttpSettings(timeout_s=WAIT_S * 2, retries=0, concurrency=8, max_concurrency=8)
    slow_reads, fast_reads = RangeClient(settings), RangeClient(settings)
    try:
        silent.hold()
        n = PYTHON_TURNS * 3
        got = [bytearray(16) for _ in range(n)]
        errors: list[BaseException] = []

        def read(i: int) -> None:
            try:
                slow_reads.read_into(f"{silent.url}/silent/train_x.npy", 128 + 64 * i, [memoryview(got[i])])
            except BaseException as err:  # noqa: BLE001 - reported by the test below
                errors.append(err)

        threads = [threading.Thread(target=read, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        wait_until(lambda: silent.inflight >= n, lambda: f"{silent.inflight} of {n} GETs outstanding")

        mine = bytearray(64)
        fast_reads.read_into(f"{other.url}/other/train_x.npy", 128, [memoryview(mine)])
        assert bytes(mine) == (tmp_path / "other" / "train_x.npy").read_bytes()[128:192]
        assert silent.inflight >= n, "the silent store answered before it was released"

        silent.release()
        for t in threads:
            t.join(WAIT_S)
        assert not errors, errors
        raw = (tmp_path / "silent" / "train_x.npy").read_bytes()
        assert [bytes(b) for b in got] == [raw[128 + 64 * i : 144 + 64 * i] for i in range(n)]
    finally:
        silent.release()
        slow_reads.close(), fast_reads.close()
        silent.close(), other.close()
