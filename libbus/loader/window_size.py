"""How many batches a loader keeps in flight when ``inflight`` is left to it (``inflight=None``).

A dataset on a provider's own disk needs few: :data:`START` requests hide a reply's round trip and the
provider's read. A dataset its provider reads from a store over the network needs as many as the store's
round trips take to cover: the bytes in flight must hold the link's bandwidth-delay product, which the
loader cannot know before it reads. So, for such a dataset (DatasetInfo's ``remote``), the loader grows
its window while batches arrive faster for it, as TCP grows its congestion window:

- at each size it counts the batches that arrive, past those asked for under the size before, and
  takes their rate (and their mean round trip) over :attr:`WindowSizer.measured` arrivals;
- a measurement during which the loop kept the loader waiting (:meth:`WindowSizer.held`: a step
  slower than the data, an evaluation, a checkpoint) for more than :data:`HELD_MOST` of its time says
  nothing of the link: it is dropped and taken again;
- while a step (half the window again, :func:`next_size`) left batches arriving no slower than the best
  size did (within :data:`FLAT`: a flat rate measures a little up or down), it takes the next one, up to
  ``most`` (:data:`MOST`, and the ring's bytes, :func:`most_for`); near a link's cap each step brings
  little, and the last few per cent come from the larger windows; a step that measured slower is
  measured once more (near a cap a measurement's noise, on a busy machine, is as large as a step's
  gain: judged on one, a capped link's window stopped at 4 or 6 in 7 runs of 16), and goes back to the
  best size only if both measurements together are slower;
- it takes no step whose round trips would pass :data:`TRIP_SHARE` of the request timeout, were the
  batches to arrive no faster (a store already answering as fast as it can: every batch more in flight
  only waits longer, against the loader's timeout and the provider's deadline);
- settled, it tries again after :data:`PROBE_AGAIN_S` (the store, the link or the training step may
  have changed); a request that timed out puts it back at :data:`START`, settled.

A training step slower than the data keeps the window where it is: every measurement is dropped, the
loop holding the loader waiting, and batches would arrive no faster anyway. A window given as a number
(``inflight=8``) is kept as given.
"""

from __future__ import annotations

import math

from libbus.constants import LOADER_INFLIGHT

__all__ = [
    "FLAT",
    "HELD_MOST",
    "MOST",
    "PROBE_AGAIN_S",
    "RING_BYTES_MOST",
    "START",
    "TRIP_SHARE",
    "WindowSizer",
    "most_for",
    "next_size",
]

#: The window a loader starts with, and keeps for a dataset its provider reads from its own disk.
START = LOADER_INFLIGHT
#: The largest window a loader grows to by itself.
MOST = 12
#: The ring's bytes a grown window may take at most: no more slots than fit in this.
RING_BYTES_MOST = 256 << 20
#: Rates within this factor of each other are the same rate (a flat rate, measured, moves by this much).
FLAT = 1.04
#: Seconds a settled window waits before it tries one step more again.
PROBE_AGAIN_S = 60.0
#: The share of a measurement's time the loop may keep the loader waiting for the measurement to count.
HELD_MOST = 0.25
#: The share of the request timeout a step's round trips may reach, were batches to arrive no faster.
TRIP_SHARE = 0.5


def next_size(window: int, most: int) -> int:
    """The window one step up: half again, at least one more, at most ``most``."""
    return min(most, window + max(1, window // 2))


def most_for(slot_bytes: int, start: int = START) -> int:
    """The largest window for batches of ``slot_bytes`` each: :data:`MOST`, fewer where the ring's
    slots (a window's batches and two more) would pass :data:`RING_BYTES_MOST`, never under ``start``."""
    return max(start, min(MOST, RING_BYTES_MOST // max(1, slot_bytes) - 2))


class WindowSizer:
    """The window of one loader's requests for a dataset read over the network (see the module
    docstring). :meth:`arrived` and :meth:`timed_out` take the time from the caller's clock;
    ``timeout_s`` is the loader's request timeout."""

    def __init__(self, start: int = START, most: int = MOST, timeout_s: float = math.inf):
        self.start, self.most, self.timeout_s = start, max(start, most), timeout_s
        #: The batches to keep in flight now.
        self.window = start
        self._best: tuple[int, float] | None = None  # (size, rate) of the best size measured since settling
        self._settled_until: float | None = None
        #: A size measured slower than the best once: (its arrivals, their seconds), measured again now.
        self._doubt: tuple[int, float] | None = None
        self._measuring_from(start)

    def _measuring_from(self, window: int) -> None:
        if window != self.window:
            self._doubt = None
        self.window = window
        self._skip = window  # those arrive from requests sent under the size before
        self._first: float | None = None
        self._count = 0
        self._held = 0.0
        self._trips = 0.0

    @property
    def measured(self) -> int:
        """Arrivals a size's rate is taken over."""
        return max(24, 4 * self.window)

    def arrived(self, now: float, round_trip_s: float = 0.0) -> int:
        """One batch arrived at ``now``, ``round_trip_s`` after it was asked for: the window to keep
        from now on."""
        if self._settled_until is not None:
            if now < self._settled_until:
                return self.window
            self._settled_until, self._best = None, None  # measure the size kept, then try one step more
            self._measuring_from(self.window)
        if self._skip:
            self._skip -= 1
        elif self._first is None:
            self._first = now
        else:
            self._count += 1
            self._trips += round_trip_s
            if self._count >= self.measured:
                took = max(now - self._first, 1e-9)
                if self._held > HELD_MOST * took:  # the loop's pace, not the link's: measure again
                    self._measuring_from(self.window)
                    self._skip = 0
                else:
                    self._decide(self._count, took, self._trips / self._count, now)
        return self.window

    def held(self, seconds: float) -> None:
        """The loop kept the loader waiting ``seconds`` (it had every batch it may ask for, or took none)."""
        if self._first is not None:
            self._held += seconds

    def timed_out(self, now: float) -> int:
        """A request of the window went unanswered within its timeout: back to :data:`START`, settled."""
        self._best, self._doubt = None, None
        self._measuring_from(self.start)
        self._settled_until = now + PROBE_AGAIN_S
        return self.window

    def _decide(self, count: int, took: float, trip: float, now: float) -> None:
        """A size measured: ``count`` arrivals in ``took`` seconds, ``trip`` seconds each round trip on
        average (with the size's first measurement, where it is measured a second time)."""
        if self._doubt is not None:
            count, took = count + self._doubt[0], took + self._doubt[1]
        rate = count / took
        if self._best is None or rate >= self._best[1]:
            self._best = (self.window, rate)
        if rate * FLAT >= self._best[1]:  # no slower than the best: one step more, where its round trips fit
            step = next_size(self.window, self.most)
            if step > self.window and trip * step / self.window <= TRIP_SHARE * self.timeout_s:
                self._measuring_from(step)
                return
        elif self._doubt is None:  # slower, once: measured again before it is given up
            self._doubt = (count, took)
            self._measuring_from(self.window)
            self._skip = 0  # every request in flight was sent under this size
            return
        else:  # the step cost, measured twice: back to the best size
            self._measuring_from(self._best[0])
        self._doubt = None
        self._settled_until = now + PROBE_AGAIN_S
