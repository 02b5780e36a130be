"""A loader that leaves ``inflight`` to itself grows its window for a dataset read over the network, while
batches arrive faster for it (libbus.loader.window_size): first the sizer alone, driven by a link whose
rate is set by the window (arrival times computed, not slept); then real loaders against a real provider
reading a real HTTP store whose every GET waits, and a local dataset beside it."""

import time

import numpy as np
import pytest

from libbus.errors import BadRequest
from libbus.loader.remote import RemoteLoader
from libbus.loader.window_size import FLAT, MOST, PROBE_AGAIN_S, RING_BYTES_MOST, START, WindowSizer, most_for
from services.provider.sources import open_source
from tests.support.httpd import RangeServer

#: A liveness bound, not a timing: far above anything the loaders below take on a loaded machine.
STUCK_S = 120


def drive(sizer: WindowSizer, rate_of, arrivals: int, now: float = 0.0) -> tuple[float, list[int]]:
    """``arrivals`` batches arriving at ``rate_of(window)`` a second, each ``window / rate`` after it was
    asked for (Little's law); the clock after them, and the window after each."""
    windows = []
    for _ in range(arrivals):
        rate = rate_of(sizer.window)
        now += 1.0 / rate
        windows.append(sizer.arrived(now, sizer.window / rate))
    return now, windows


def latency_bound(window: int) -> float:
    return window / 0.03  # every batch one 30 ms round trip, as many at once as the window


def test_a_window_bound_by_round_trips_grows_half_again_each_step_up_to_its_most():
    sizer = WindowSizer()
    _, windows = drive(sizer, latency_bound, 300)
    assert sorted(set(windows)) == [START, 6, 9, MOST]  # each step half again
    assert windows[-1] == MOST


def test_near_a_links_cap_steps_that_bring_little_are_taken_while_they_cost_nothing():
    cap = 6.2 / 0.03  # the link carries 6.2 batches' worth: 9 in flight bring 6.2/6 of what 6 did
    assert 1 < cap / latency_bound(6) < FLAT
    sizer = WindowSizer()
    _, windows = drive(sizer, lambda w: min(latency_bound(w), cap), 300)
    assert windows[-1] == MOST


def test_a_step_that_cost_goes_back_to_the_best_size():
    sizer = WindowSizer()  # 9 in flight are slower than 6 (a store that slows down under more requests)
    _, windows = drive(sizer, lambda w: latency_bound(w) if w <= 6 else 0.8 * latency_bound(6), 300)
    assert 9 in windows and windows[-1] == 6


def test_a_step_measured_slower_once_is_measured_again_before_it_is_given_up():
    """Near a link's cap one measurement's noise is as large as a step's gain: a step whose first
    measurement came out slow (the machine busy for that moment) is measured again, and kept when the two
    together are no slower than the best size."""
    at_nine = {"arrivals": 0}

    def rate(w: int) -> float:
        if w == 9:
            at_nine["arrivals"] += 1
            if at_nine["arrivals"] <= 9 + 1 + 36:  # those skipped, the first, and one measurement's 36
                return 0.6 * latency_bound(9)  # below 6's rate by more than FLAT: measured "slower"
        return latency_bound(w)

    sizer = WindowSizer()
    _, windows = drive(sizer, rate, 400)
    assert 0.6 * latency_bound(9) * FLAT < latency_bound(6)
    assert windows[windows.index(9) :].count(6) == 0  # never back to 6
    assert windows[-1] == MOST


def test_a_store_whose_round_trips_near_the_timeout_keeps_the_window():
    # a full shuffle without a cache: 1.1 batches a second whatever the window, 3.6 s a round trip at 4
    sizer = WindowSizer(timeout_s=10.0)
    _, windows = drive(sizer, lambda w: 1.1, 100)
    assert set(windows) == {START}  # 6 in flight would wait 5.5 s each: past half the timeout


def test_measurements_the_loop_held_are_dropped():
    sizer = WindowSizer()
    now = 0.0
    for _ in range(300):  # a step slower than the data: the loader waits on the loop a third of the time
        now += 1.0 / latency_bound(sizer.window)
        sizer.held(0.5 / latency_bound(sizer.window))
        assert sizer.arrived(now, 0.03) == START


def test_a_settled_window_tries_one_step_more_again_later():
    sizer = WindowSizer()
    store = {"slower_past": 6}  # more than 6 in flight slow the store down

    def rate(w: int) -> float:
        return latency_bound(w) if w <= store["slower_past"] else 0.8 * latency_bound(store["slower_past"])

    now, windows = drive(sizer, rate, 300)
    assert windows[-1] == 6
    now, windows = drive(sizer, rate, 50, now)
    assert set(windows) == {6}  # settled: no probing until PROBE_AGAIN_S has passed
    store["slower_past"] = MOST  # the store got faster
    sizer.arrived(now + PROBE_AGAIN_S, 0.03)
    _, windows = drive(sizer, rate, 300, now + PROBE_AGAIN_S)
    assert windows[-1] == MOST


def test_a_timed_out_request_puts_the_window_back_at_its_start_settled():
    sizer = WindowSizer()
    now, windows = drive(sizer, latency_bound, 300)
    assert windows[-1] == MOST
    assert sizer.timed_out(now) == START
    _, windows = drive(sizer, latency_bound, 100, now)
    assert set(windows) == {START}


def test_large_batches_grow_the_window_less():
    assert most_for(1 << 20) == MOST
    assert most_for(RING_BYTES_MOST // 8) == 6  # 8 slots of these: 6 in flight and two more
    assert most_for(RING_BYTES_MOST) == START  # never under the start
    assert most_for(RING_BYTES_MOST, start=2) == 2


# -- real loaders ------------------------------------------------------------------------------------
DELAY_S = 0.1  # every GET's wait: a far bucket, far above a loaded machine's own delays


@pytest.fixture
def store(tmp_path):
    rng = np.random.default_rng(0)
    folder = tmp_path / "tok"
    folder.mkdir()
    for i in range(2):
        (folder / f"shard-{i:02d}.bin").write_bytes(rng.integers(0, 60000, 16 * 160).astype("<u2").tobytes())
    server = RangeServer(tmp_path)
    server.delay_s = DELAY_S
    yield f"{server.url}/tok/shard-{{00..01}}.bin?seq_len=15&token_bytes=2&retries=2&timeout=20"
    server.close()


def read_until(loader: RemoteLoader, grown, uri: str) -> int:
    """Read whole epochs until ``grown()``, every batch checked against the source; the batches read."""
    source = open_source(uri)
    deadline, n = time.monotonic() + STUCK_S, 0
    while not grown():
        assert time.monotonic() < deadline, f"the window stayed at {loader.inflight}"
        order = loader.order(loader.epoch)
        got = np.concatenate([x.numpy().copy() for x, _ in loader])  # not held: views would hold ring slots
        want, _ = source.read("train", order)
        assert np.array_equal(got, want)
        n += len(loader)
    return n


def test_a_loader_left_to_size_its_window_grows_it_for_a_store_and_reads_the_same_batches(
    store, start_provider, make_token
):
    provider = start_provider(f"far={store}")
    with RemoteLoader("far", provider=provider.endpoint, token=make_token(), batch_size=2, shuffle="block") as loader:
        assert loader.info.get("remote") is True
        assert loader.inflight == START
        assert loader.links.links.slots == MOST + 2  # ring slots for the largest window it may grow to
        read_until(loader, lambda: loader.inflight > START, store)


def test_a_window_given_is_kept_and_a_local_dataset_keeps_the_start(store, start_provider, make_token):
    provider = start_provider(f"far={store}", "near=mock://mnist?n=600")
    with RemoteLoader(
        "far", provider=provider.endpoint, token=make_token(), batch_size=2, shuffle="block", inflight=4
    ) as loader:
        assert sum(1 for _ in loader) == len(loader) > 100  # where a window left to it grows
        assert loader.inflight == 4 and loader.links.sizer is None
        assert loader.links.links.slots == 6
    with RemoteLoader("near", provider=provider.endpoint, token=make_token(), batch_size=50) as loader:
        assert "remote" not in loader.info and loader.links.sizer is None
        assert loader.inflight == START and loader.links.links.slots == START + 2


def test_a_growing_window_keeps_within_the_ring_slots_given(store, start_provider, make_token):
    provider = start_provider(f"far={store}")
    with RemoteLoader(
        "far", provider=provider.endpoint, token=make_token(), batch_size=2, shuffle="block", shm_slots=7
    ) as loader:
        assert loader.links.links.slots == 7
        read_until(loader, lambda: loader.links.inflight_wanted > START, store)
        assert loader.inflight <= 6
        assert sum(1 for _ in loader) == len(loader)
        assert loader.inflight <= 6


def test_inflight_must_be_a_positive_number_or_none(provider, make_token):
    for bad in (0, -1):
        with pytest.raises(BadRequest, match="inflight must be at least 1"):
            RemoteLoader("mnist", provider=provider.endpoint, token=make_token(), inflight=bad)
