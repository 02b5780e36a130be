"""How many requests one remote dataset keeps in flight: a limit that follows the bandwidth-delay product.

A store 30 ms away that answers a 12 KiB range per request delivers, with ``k`` requests in flight, at
most ``k × 12 KiB / 30 ms``: the link is full only when the bytes in flight reach bandwidth × round
trip. Neither is known in advance (a store's first byte takes 10 to 100 ms, a link is 1 to 100 Gbit/s,
and other datasets share both), so an :class:`InflightLimit` finds the limit by climbing: it starts at
``start`` and, over windows of completed requests during which the limit was reached (the dataset
wanted more), multiplies it by :data:`GROW` while the bytes per second keep rising by at least
:data:`GAIN`; a step up that did not pay is taken back; a rate that falls at the same limit (the link
or the store is busier) steps it down by :data:`SHRINK`, never below ``start``; the window after a step
down judges it: a rate that fell again by :data:`GAIN` says the limit, not the store, was holding the
dataset back, and the step is taken back (compared with the window before, at the larger limit, a limit
that binds always looks worse: read as congestion, each step down called for the next, down to ``start``);
after :data:`PROBE_WINDOWS` steady windows it tries one step up again. Windows of unlike reads (bytes per
request apart by more than :data:`SIZE_CHANGE`) are not compared: the first of the new kind starts afresh. A throttled request (HTTP 429 or
503, S3's ``SlowDown``) halves it at once. It never leaves ``[1, cap]``; the host's own cap (all the
provider's datasets on that host together) is a :func:`host_slots` semaphore held beside it.

The limit is per dataset, shared by all its batches in flight: the provider reads several batches of a
remote dataset at once (:mod:`services.provider.fillers`), and their requests queue here together.
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = [
    "GAIN",
    "GROW",
    "SHRINK",
    "READER_NICE",
    "InflightLimit",
    "Line",
    "Slots",
    "host_slots",
    "lower_priority",
    "lower_process_priority",
]

#: The limit's step up while throughput rises, and down once it stops.
GROW, SHRINK = 1.5, 0.8
#: A rise in bytes per second that counts as one (below it, noise).
GAIN = 1.1
#: Windows whose bytes per request differ by more than this factor read different things: not compared.
SIZE_CHANGE = 4.0
#: A window closes after at least this long and at least ``limit`` completed requests.
WINDOW_S = 0.25
#: Windows of steady throughput after which the limit tries one step up again (the link may have freed).
PROBE_WINDOWS = 8

#: The niceness of the threads that read from a store (Linux: per thread). A remote dataset read at full
#: speed keeps a hundred of them busy parsing replies; at the serving loop's priority they take the cores
#: (and the GIL) from it, and a local dataset's p99 wait beside one went from 4 ms to 210-280 ms on two
#: cores; at 10 it stayed at 13-37 ms (docs/performance.md, "Data behind a network").
READER_NICE = 10

_HOSTS_LOCK = threading.Lock()


def lower_priority() -> None:
    """Run the calling thread at :data:`READER_NICE` and under ``SCHED_BATCH`` (a reader pool's
    ``initializer``; threads it starts later inherit both); where the system refuses either, at the
    priority it has. The read helper lowers all its threads at once (:func:`lower_process_priority`).

    ``SCHED_BATCH`` keeps the readers from preempting anything when they wake: a reply's thread then waits
    for the scheduler's turn instead of taking the core from the serving loop or a trainer's loop in the
    middle of its work. Niced alone, they still did: on two cores, the loop of a trainer reading a local
    dataset beside a remote one was switched out ~50 times in 5 s by the read helper's threads (`perf`
    ``sched_switch``); none alone. They keep their share of the cores: a machine with cores to spare reads
    the remote dataset as fast as before."""
    _lower(threading.get_native_id())


def lower_process_priority() -> None:
    """:func:`lower_priority` for every thread of this process now (a process that only reads, as the read
    helper: numpy's threads started at import included); the threads its threads start later inherit it."""
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread at least
        threads = [threading.get_native_id()]
    for tid in threads:
        _lower(tid)


def _lower(tid: int) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, tid, READER_NICE)
    except (AttributeError, OSError):
        pass
    try:
        os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):
        pass


class Line:
    """Callers waiting for places, served earliest ``due`` first (a batch's deadline), then in the order
    they came; each waits on a condition of its own and is woken alone, when it is first in line and a
    place is free. Served in arrival order instead, every batch in flight got a share of each place
    freed, all of them finished together, late, and past their deadline they were asked again: a store
    answering 400 requests a second behind 8 batches of 370 requests each fell from 300 samples/s to 34
    (docs/performance.md, "Data behind a network"). The caller holds ``lock`` around each call."""

    def __init__(self, lock: threading.Lock):
        self._lock = lock
        self._queue: list[tuple[tuple[float, int], threading.Condition]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._queue)

    def wait(self, n: int, fits: Callable[[int], bool], deadline: float | None, due: float | None) -> bool:
        """Wait until this caller is first in line and ``fits(n)``; False when ``deadline`` passed first."""
        if not self._queue and fits(n):
            return True
        me = (due if due is not None else deadline if deadline is not None else math.inf, next(self._order))
        turn = threading.Condition(self._lock)
        heapq.heappush(self._queue, (me, turn))
        try:
            while self._queue[0][0] != me or not fits(n):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                turn.wait(left)
            heapq.heappop(self._queue)
            return True
        finally:
            if any(entry[0] == me for entry in self._queue):  # gave up waiting
                self._queue = [entry for entry in self._queue if entry[0] != me]
                heapq.heapify(self._queue)
            self.wake(fits)

    def wake(self, fits: Callable[[int], bool]) -> None:
        """Wake the first in line if a place is free (it wakes the next once it has taken its own)."""
        if self._queue and fits(1):
            self._queue[0][1].notify()


class Slots:
    """At most ``limit`` requests at once, a caller taking one or several places together (the ranges of one
    call that sends them side by side), all or none; one asking for more than ``limit`` runs alone. Places
    go earliest ``due`` first (:class:`Line`)."""

    def __init__(self, limit: int):
        self.limit = max(1, limit)
        self._held = 0
        self._lock = threading.Lock()
        self._line = Line(self._lock)

    def _fits(self, n: int) -> bool:
        return not self._held or self._held + n <= self.limit

    def acquire(self, n: int = 1, timeout: float | None = None, due: float | None = None) -> bool:
        """Take ``n`` places; False when they were not free within ``timeout`` (``None``: no bound)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if not self._line.wait(n, self._fits, deadline, due):
                return False
            self._held += n
            return True

    def release(self, n: int = 1) -> None:
        with self._lock:
            self._held -= n
            self._line.wake(self._fits)

    def __enter__(self) -> Slots:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


_HOSTS: dict[str, Slots] = {}


def host_slots(host: str, limit: int) -> Slots:
    """The provider-wide :class:`Slots` of requests in flight to ``host`` (the first caller sets its size)."""
    with _HOSTS_LOCK:
        if host not in _HOSTS:
            _HOSTS[host] = Slots(limit)
        return _HOSTS[host]


class InflightLimit:
    """At most :attr:`limit` requests at once, the limit climbing with throughput (see the module doc)."""

    def __init__(self, start: int, cap: int):
        self.cap = max(1, cap)
        self.start = min(max(1, start), self.cap)
        #: Requests allowed in flight now.
        self.limit = self.start
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._inflight = 0
        self._window = (time.monotonic(), 0, 0)  # (started, requests done, bytes done)
        self._full = False  # the limit was reached during this window
        self._last_rate = 0.0  # bytes/s of the last window that counted
        self._before: int | None = None  # the limit before the last step up, until that step proves itself
        self._above: int | None = None  # the limit before the last step down, until the next window judges it
        self._flat = 0  # windows in a row with the rate steady
        self._size = 0.0  # bytes a request in the last window judged
        self._line = Line(self._lock)  # requests waiting for a place now

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def waiting(self) -> int:
        """Requests waiting for a place now."""
        return len(self._line)

    def acquire(self, timeout_s: float | None = None, n: int = 1, due: float | None = None) -> bool:
        """Take a place (``n`` places, all or none: requests sent together; more than the limit only when
        none is taken); False when they did not come within ``timeout_s`` (``None``: wait as long as it
        takes). Places go earliest ``due`` first (a batch's deadline; default: this call's own), then
        first come (:class:`Line`): the requests of the batch asked for first go before those behind it."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            if self._line or not self._fits(n):
                self._full = True  # the limit holds a request back
            if not self._line.wait(n, self._fits, deadline, due):
                return False
            self._inflight += n
            if self._inflight >= self.limit:
                self._full = True
            return True

    def _fits(self, n: int) -> bool:
        return not self._inflight or self._inflight + n <= self.limit

    def release(self, nbytes: int = 0, throttled: bool = False, n: int = 1) -> None:
        """Give the place (``n`` places) back, counting ``nbytes`` delivered by its ``n`` requests;
        ``throttled``: the store asked us to slow down."""
        with self._cond:
            self._inflight -= n
            if throttled:
                self.limit, self._before, self._above = max(1, self.limit // 2), None, None
                self._window, self._full = (time.monotonic(), 0, 0), False
            else:
                self._count(nbytes, n)
            # wake only the first in line: waking all of them (a hundred reader threads of a busy
            # dataset) to find the one place taken costs each a GIL turn, taken from the serving loop
            self._line.wake(self._fits)

    @contextmanager
    def slot(self) -> Iterator[list[int]]:
        """A place for one request: ``with limit.slot() as done: ...; done.append(nbytes)``."""
        self.acquire()
        done: list[int] = []
        try:
            yield done
        finally:
            self.release(sum(done))

    def _count(self, nbytes: int, n: int = 1) -> None:
        started, requests, total = self._window
        requests, total = requests + n, total + nbytes
        now = time.monotonic()
        if now - started < WINDOW_S or requests < self.limit:
            self._window = (started, requests, total)
            return
        if self._full and self._line:  # the limit held the dataset back all along: its rate is the limit's
            self._step(total / (now - started), total / requests)
        self._window, self._full = (now, 0, 0), False

    def _step(self, rate: float, size: float = 0.0) -> None:
        """One window's verdict (caller holds the lock): ``rate`` bytes per second, ``size`` bytes a request."""
        if size and self._size and not self._size / SIZE_CHANGE <= size <= self._size * SIZE_CHANGE:
            # other reads now (a block shuffle's megabytes a request, then a full shuffle's kilobytes): the
            # last window's rate says nothing of this one's; without this, a full shuffle's first step up was
            # judged against a block shuffle's bytes per second, taken back, and the limit sat at its start
            self._last_rate, self._before, self._above = 0.0, None, None
        self._size = size or self._size
        if rate >= self._last_rate * GAIN and self.limit < self.cap:  # the last step paid (or the link grew)
            self._before, self._above, self.limit = self.limit, None, min(self.cap, math.ceil(self.limit * GROW))
        elif self._before is not None and rate < self._last_rate * GAIN:  # a step up that did not pay
            self.limit, self._before = self._before, None
        elif self._above is not None:  # the window after a step down: did the store get busier, or did we?
            if rate < self._last_rate / GAIN:  # the step down cost throughput: the limit held it back, put it back
                self.limit = self._above
            self._above = None
        elif rate < self._last_rate / GAIN:  # worse at the same limit: congestion elsewhere
            self._above, self.limit = self.limit, max(self.start, math.floor(self.limit * SHRINK))
        else:
            self._flat += 1
            if self._flat >= PROBE_WINDOWS and self.limit < self.cap:  # steady a while: see if more pays now
                self._before, self.limit, self._flat = self.limit, min(self.cap, math.ceil(self.limit * GROW)), 0
        self._last_rate = rate
