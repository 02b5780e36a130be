"""A remote dataset's places for requests go to the batch due first, not to whichever request came first.

Served in arrival order, every batch in flight got a share of each place freed: all of them finished
together, late, and past their deadline they were asked again (a store answering 400 requests a second
behind 8 batches of 370 requests each fell from 300 samples/s to 34, and at 100 ms a request its
provider was dropped). Real threads wait on a real :class:`InflightLimit` here."""

from __future__ import annotations

import threading
import time

from services.provider.sources.storage.inflight import InflightLimit, Slots


def _waiting(limit: InflightLimit, n: int) -> None:
    deadline = time.monotonic() + 30
    while limit.waiting < n:
        assert time.monotonic() < deadline, f"{limit.waiting} of {n} waiters queued"
        time.sleep(0.005)


def _waiter(limit: InflightLimit, due: float, got: list[float], timeout_s: float | None = None) -> threading.Thread:
    def run() -> None:
        if limit.acquire(timeout_s, due=due):
            got.append(due)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_places_freed_go_to_the_earliest_due_request_whatever_the_order_they_came_in():
    limit = InflightLimit(start=1, cap=1)
    assert limit.acquire(0)  # the one place, held
    got: list[float] = []
    threads = []
    for i, due in enumerate((30.0, 10.0, 20.0, 10.0)):  # the later batch's requests came first
        threads.append(_waiter(limit, due, got))
        _waiting(limit, i + 1)
    for n in range(4):
        limit.release(1024)
        deadline = time.monotonic() + 30
        while len(got) < n + 1:
            assert time.monotonic() < deadline, f"a freed place reached no waiter: {got}"
            time.sleep(0.005)
    assert got == [10.0, 10.0, 20.0, 30.0]
    limit.release(1024)
    assert limit.inflight == 0 and all(not t.join(10) and not t.is_alive() for t in threads)


def test_one_that_gives_up_first_in_line_passes_its_turn_on_and_none_is_stranded():
    """A waiter whose own time ran out leaves the line; the next is woken by the place freed after, and
    a place freed while nobody fits strands nobody (each waiter is woken alone, so a lost wake-up would
    hang it: every waiter here must end)."""
    limit = InflightLimit(start=2, cap=2)
    assert limit.acquire(0) and limit.acquire(0)
    assert not limit.acquire(0.05, due=1.0)  # first in line, gave up: the line is empty again
    got: list[float] = []
    later = _waiter(limit, 5.0, got)
    _waiting(limit, 1)
    quitter = _waiter(limit, 2.0, got, timeout_s=0.05)  # ahead of it, and gives up
    quitter.join(30)
    assert not quitter.is_alive() and got == []
    limit.release(1024)
    later.join(30)
    assert not later.is_alive() and got == [5.0]
    # a bundle first in line waits for all its places; one behind it that would fit waits its turn
    bundle_got: list[float] = []
    bundle = threading.Thread(target=lambda: limit.acquire(None, n=2, due=1.0) and bundle_got.append(1.0), daemon=True)
    bundle.start()
    _waiting(limit, 1)
    single = _waiter(limit, 9.0, got)
    _waiting(limit, 2)
    limit.release(1024)  # one place free: not enough for the bundle, and the single is behind it
    time.sleep(0.05)
    assert bundle_got == [] and got == [5.0]
    limit.release(1024)
    bundle.join(30)
    assert bundle_got == [1.0]
    limit.release(2048, n=2)
    single.join(30)
    assert got == [5.0, 9.0] and limit.inflight == 1


def test_the_hosts_places_go_earliest_due_first_too():
    """The provider-wide places for one store host (every dataset on it) keep the same order: a batch's
    requests are not overtaken there by the batches asked for after it."""
    host = Slots(1)
    assert host.acquire()
    got: list[float] = []

    def wait(due: float) -> None:
        if host.acquire(due=due):
            got.append(due)
            host.release()

    threads = []
    for i, due in enumerate((3.0, 1.0, 2.0)):
        threads.append(threading.Thread(target=wait, args=(due,), daemon=True))
        threads[-1].start()
        deadline = time.monotonic() + 30
        while len(host._line) < i + 1:
            assert time.monotonic() < deadline, "a waiter never queued"
            time.sleep(0.005)
    host.release()
    for t in threads:
        t.join(30)
    assert got == [1.0, 2.0, 3.0] and not any(t.is_alive() for t in threads)
