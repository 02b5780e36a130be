"""The hand-off between a pass's own thread and the loop that iterates the loader.

A :class:`~libbus.loader.remote.RemoteLoader` pass runs its requests, replies, retries and the batches'
hand-out on a thread of the pass's own, so the training loop's ``next()`` takes a batch already made:
the loop waits for data only when the data is not there yet, never for the loader's bookkeeping (as
``DataLoader``'s pin-memory thread takes the copy into pinned memory off the loop). Measured by
``busctl bench --wait``: ``docs/performance.md``.

The pass keeps the order of events of a loader on one thread:

- the consumer's n-th ``next()`` asks for batch n-1 and lets go of batch n-2; the pass thread lets a
  batch go (``RequestWindow.advance``) only then, so the request window, and with it the ring slots
  in use, is what a single-threaded pass would have;
- the pass thread makes ready at most the batch asked for and the one after it;
- an error the pass meets reaches the consumer at the batch where it happened, as the exception
  itself (its traceback shows the pass thread's frames);
- the pass thread owns the pass's sockets until it ends: the consumer stops it (:meth:`Handoff.stop`)
  and joins it before anything else touches them.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from libbus.errors import BusError
from libbus.loader.delivery_protocol import Delivery

__all__ = ["Ended", "Handoff", "Raised", "Ready"]


@dataclass(frozen=True)
class Ready:
    """A batch made ready by the pass thread."""

    batch_no: int
    delivery: Delivery
    #: The batch itself when ``handed``; else what ``delivery.receive`` made of the reply, for the
    #: consumer's thread to hand out (a CUDA copy orders the consumer's own stream after it).
    item: Any
    handed: bool
    #: The replica that served it (a label), its request's round trip and the provider's timing.
    replica: str
    round_trip_s: float
    timing: Any


@dataclass(frozen=True)
class Raised:
    """The pass ended with ``error``: the consumer raises it at this point of the pass."""

    error: BaseException


@dataclass(frozen=True)
class Ended:
    """Every batch of the pass was taken, and the consumer came back after the last."""


Item = Ready | Raised | Ended


class Handoff:
    """What passes between the consumer and the pass thread (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: deque[Item] = deque()
        #: ``next()`` calls of the consumer so far (the first asks for batch 0).
        self.asked = 0
        #: Set by :meth:`stop`: the pass thread ends at its next check.
        self.stopped = False
        #: Passes that took over the thread of the pass before them (:meth:`carry_on`).
        self.carried = 0

    # -- the consumer's side --------------------------------------------------------------------------
    def ask(self) -> tuple[Item, bool]:
        """Ask for the next batch (letting go of the one before it): ``(item, blocked)``, where
        ``blocked`` says whether the consumer had to wait for it."""
        with self._cond:
            self.asked += 1
            self._cond.notify_all()
            blocked = not self._items
            while not self._items:
                self._cond.wait()
            return self._items.popleft(), blocked

    def carry_on(self) -> None:
        """A new pass takes over this thread (its first batches were asked for ahead): the thread does
        what it does before a pass (:meth:`~libbus.loader.replica_set.ReplicaSet.readmit`)."""
        with self._cond:
            self.carried += 1
            self._cond.notify_all()

    def stop(self) -> None:
        """End the pass: the pass thread stops at its next check (within
        :data:`~libbus.loader.pass_pipeline.STOP_CHECK_S`); a consumer still waiting in :meth:`ask` (on
        another thread) gets an error."""
        with self._cond:
            self.stopped = True
            self._items.append(Raised(BusError("the loader was closed during the pass")))
            self._cond.notify_all()

    def drop_ready(self) -> None:
        """Forget the batches made ready and not taken (of a pass stopped: their ring slots go back as
        their tensors go)."""
        with self._cond:
            self._items = deque(item for item in self._items if not isinstance(item, Ready))

    @property
    def going(self) -> bool:
        """Not stopped, and the pass thread has put no error and no end: it still makes batches ready."""
        with self._cond:
            return not self.stopped and not any(isinstance(item, Raised | Ended) for item in self._items)

    # -- the pass thread's side -------------------------------------------------------------------
    def put(self, item: Item) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()

    def wait_asked(self, seen: int) -> None:
        """Block until the consumer asks past ``seen``, or the pass is stopped."""
        with self._cond:
            carried = self.carried
            while self.asked == seen and not self.stopped and self.carried == carried:
                self._cond.wait()
