"""What a :class:`~libbus.loader.remote.RemoteLoader` pass runs on its own thread: its requests and replies.

:class:`PassPipeline` keeps ``inflight`` batch requests out across the replicas, waits for what comes
back, acts on each explicit outcome of the request window (:data:`~libbus.loader.window.Outcome`: a batch
arrived, a connection lost, a request overdue, a provider going away...) and makes ready the batch the
consumer asked for and the one after it (:mod:`libbus.loader.handoff`). The loader itself keeps the
cursor, the order and the consumer's side; the pipeline touches only the connections
(:class:`~libbus.loader.replica_set.ReplicaSet`), which it owns until the pass ends.

:func:`settle_ring_requests` is the pass's last word once its thread has ended: ring slots a provider
may still be writing into are waited for, or taken out of use, before another batch goes into them.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from libbus.loader.batch_stream import BatchStream
from libbus.loader.context import yield_to_the_loop
from libbus.loader.delivery_protocol import Delivery
from libbus.loader.handoff import Ended, Handoff, Raised, Ready
from libbus.loader.readahead import ReadAheadPlan
from libbus.loader.replica import ReplyPoller, recv_any
from libbus.loader.replica_set import ReplicaSet
from libbus.loader.window import (
    Arrived,
    ConnectionLost,
    Failed,
    GoingAway,
    Late,
    NoReplica,
    NothingPending,
    Outcome,
    RequestWindow,
    SessionExpired,
    TimedOut,
)
from libbus.wire.messages import BatchRequest, ReadAhead

__all__ = ["STOP_CHECK_S", "PassPipeline", "settle_ring_requests"]

#: How often, at most, a pass thread waiting for replies checks whether its pass was closed (seconds).
STOP_CHECK_S = 0.1


class PassPipeline:
    """One pass's requests and replies, run on the pass's own thread by :meth:`run`.

    Args:
        links: the loader's connections to the dataset's replicas; the pass owns them until it ends.
        dataset, split: what the requests ask for.
        first: the first sample of the loader's record range (0 for the whole split): the order's
            positions are offsets from it.
        read_ahead: batches to tell the provider ahead of those in flight (:mod:`libbus.loader.readahead`);
            0 where the provider cannot use it.
        stall_breakdown: ask the providers for each batch's timing, and hand it on with the batch.
    """

    def __init__(
        self, links: ReplicaSet, *, dataset: str, split: str, first: int, read_ahead: int, stall_breakdown: bool
    ):
        self.links = links
        self.dataset = dataset
        self.split = split
        self.first = first
        self.read_ahead = read_ahead
        self.stall_breakdown = stall_breakdown

    def run(self, batches: BatchStream, handoff: Handoff) -> None:
        """The pass thread's body: the stream's batches through ``handoff``, or the error that ended it."""
        yield_to_the_loop()
        try:
            self._pipeline(batches, handoff)
        except BaseException as err:  # noqa: BLE001 (the consumer raises it where the pass met it)
            handoff.put(Raised(err))

    def _request(self, indices: np.ndarray, fields: dict) -> BatchRequest:
        if self.first:  # the order is over the range: its positions are offsets into it
            indices = indices + self.first
        return BatchRequest.for_indices(indices, dataset=self.dataset, split=self.split, **fields)

    def _pipeline(self, batches: BatchStream, handoff: Handoff) -> None:
        """The pass, on its own thread: keep ``inflight`` requests out, act on what comes back, and
        make ready the batch the consumer asked for and the one after it (:mod:`libbus.loader.handoff`).
        Once every batch of the stream has been asked for, the next epoch's follow (:mod:`libbus.loader.batch_stream`):
        the window stays full across the epoch boundary."""
        asked_for = {"timing": True} if self.stall_breakdown else {}

        def request(n: int, fields: dict) -> BatchRequest:
            # the batch's epoch seeds a pipeline dataset's random stages: a resend gets the same bytes
            return self._request(batches[n], {**asked_for, "epoch": batches.epoch_of(n), **fields})

        window = RequestWindow(len(batches), request)
        poller = ReplyPoller()  # per pass: a socket id reused after a reconnect must not alias
        self.links.open_sessions()
        self.links.readmit()
        # the stall split: each arrived batch's (round trip, provider timing), handed on with it
        arrivals: dict[int, tuple[float, Any]] = {}
        taken: dict[int, Delivery] = {}  # batches handed to the consumer and not yet let go
        plan = self._read_ahead_plan(batches)
        carried = 0
        while not handoff.stopped:
            if handoff.carried != carried:  # a new pass took this thread over: a replica back is taken back
                carried = handoff.carried
                self.links.readmit()
            asked = handoff.asked
            while window.next_yield < min(asked - 1, window.next_take):  # the consumer let these go
                window.advance(taken.pop(window.next_yield))
            if window.next_send >= window.count and batches.extend():  # the next epoch's first batches, ahead
                window.count = len(batches)
                batches.forget_below(window.next_yield)
            if window.finished:
                handoff.put(Ended())
                return
            self.links.top_up()  # flows dropped while their provider kept answering
            window.fill(self.links.replicas, self.links.inflight)
            if plan is not None:
                plan.inflight = self.links.inflight  # a window left to the loader may have grown
                plan.at(window.next_yield)
            if window.next_take >= window.count or window.next_take > asked:
                # the consumer has the newest batch and the next one is ready: act on the replies
                # already here, then wait for the consumer to ask again
                self._take_replies(window, poller, arrivals)
                self._wait_for_consumer(handoff, asked)
                continue
            via = window.via.get(window.next_take)
            got = window.take()
            if got is not None:
                batch_no, delivery, item = got
                taken[batch_no] = delivery
                trip, timing = arrivals.pop(batch_no, (0.0, None))
                replica = via[0].label if via is not None else ""
                handed = not delivery.hand_out_in_consumer
                if handed:
                    item = delivery.hand_out(batch_no, item)
                handoff.put(Ready(batch_no, delivery, item, handed, replica, trip, timing))
                del got, item  # the consumer's alone: a batch it lets go must not stay viewed from here
                continue
            if (
                not window.again
                and window.next_take >= window.next_send
                and window.next_send - window.next_yield >= self.links.inflight
            ):
                # every batch sent was taken, and the window is full of batches the consumer holds (the
                # last of a pass, with one in flight): nothing to send or wait for until it asks again
                self._wait_for_consumer(handoff, asked)
                continue
            outcome = self._next_outcome(window, poller, STOP_CHECK_S)
            self._act(window, outcome, arrivals, handoff)

    def _wait_for_consumer(self, handoff: Handoff, asked: int) -> None:
        """Wait for the consumer to ask past ``asked``; the time it kept this thread waiting is no
        measure of the link (:meth:`ReplicaSet.held <libbus.loader.replica_set.ReplicaSet.held>`)."""
        start = time.monotonic()
        handoff.wait_asked(asked)
        self.links.held(time.monotonic() - start)

    def _take_replies(self, window: RequestWindow, poller: ReplyPoller, arrivals: dict) -> None:
        """Act on the replies that are here already, without waiting for more."""
        while any(r.pending for r in self.links.live):
            outcome = self._next_outcome(window, poller, 0.0)
            if isinstance(outcome, TimedOut) and not outcome.overdue:
                return  # nothing more is here yet
            self._act(window, outcome, arrivals)

    def _read_ahead_plan(self, batches: BatchStream) -> ReadAheadPlan | None:
        """This pass's :class:`ReadAheadPlan`, where the provider can use one and there is one provider."""
        if not self.read_ahead:
            return None
        offset = self.first

        def send(indices: np.ndarray) -> None:
            live = self.links.live
            if len({r.endpoint for r in live}) != 1:  # none, or several replicas: whoever reads is not known
                return
            frame = (indices + offset if offset else indices).astype("<i8", copy=False)
            live[0].client.send(ReadAhead(dataset=self.dataset, split=self.split, frames=[frame.data]))

        return ReadAheadPlan(batches, self.links.inflight, self.read_ahead, send)

    def _next_outcome(self, window: RequestWindow, poller: ReplyPoller, most_s: float) -> Outcome:
        """Wait, ``most_s`` at most, for what happens next to the requests of this pass (see
        :mod:`libbus.loader.window`); a wait that ends with nothing overdue is ``TimedOut(())``."""
        live = self.links.live
        if not live:
            return NoReplica()
        if not any(r.pending for r in live):
            return NothingPending()
        timeout_s = self.links.links.timeout_s
        oldest = min(r.oldest() for r in live)
        wait_s = min(most_s, max(0.0, oldest + timeout_s - time.monotonic()))
        replica, reply = recv_any(live, wait_s, poller)
        now = time.monotonic()
        overdue = [r for r in live if r.oldest() + timeout_s <= now] if replica is None else []
        return window.classify(replica, reply, overdue)

    def _act(self, window: RequestWindow, outcome: Outcome, arrivals: dict, handoff: Handoff | None = None) -> None:
        """Do what ``outcome`` calls for; raises the typed error of an ``Error`` reply, and
        :class:`PeerTimeout` when no provider comes back within ``provider_wait_s`` (the wait for
        one ends early once ``handoff`` is stopped)."""
        links = self.links
        match outcome:
            case Arrived(batch_no=batch_no, reply=reply, replica=replica):
                if self.stall_breakdown:
                    arrivals[batch_no] = (replica.round_trip_s, reply.timing)
                window.arrived(batch_no, reply)
                links.arrived(replica.round_trip_s)  # a window left to the loader may grow (libbus.loader.window_size)
            case NoReplica():
                links.await_replica(stopped=(lambda: handoff.stopped) if handoff is not None else None)
            case NothingPending():
                (links.ring or links.socket).wait_free()  # slots held by copies to the GPU still running
            case ConnectionLost(replica=replica):
                window.resend(links.lost(replica))
            case TimedOut(overdue=overdue):
                for replica in overdue:
                    window.resend(links.timed_out(replica))
            case SessionExpired(replica=replica, batch_no=batch_no):
                window.resend([batch_no, *links.strike(replica, "session expired on the provider", count=False)])
            case GoingAway(replica=replica, batch_no=batch_no, reason=reason):
                window.resend([batch_no, *links.down(replica, reason)])
            case Failed(replica=replica, reply=reply):
                replica.client.check(reply)
            case Late():
                pass  # a late reply to a request already sent again


def settle_ring_requests(links: ReplicaSet) -> None:
    """A pass that ends with ring requests in flight (left early, or failed) waits for their
    replies, ``timeout_s`` at most, before their slots carry other batches: a provider's fill
    thread may be writing one of them now (it checked the request before the pass ended), and
    would write into whatever batch the slot holds next. The slots of requests still unanswered
    then go out of use, as a provider's that stopped answering."""
    ring = links.ring
    waiting = [r for r in links.live if r.delivery is ring and r.pending]
    if ring is None or not waiting:
        return
    deadline = time.monotonic() + links.links.timeout_s
    poller = ReplyPoller()
    unanswered: list[int] = []
    while waiting:
        replica, reply = recv_any(waiting, max(0.0, deadline - time.monotonic()), poller)
        if replica is None:  # past timeout_s
            break
        if reply is None:  # its connection was lost: whatever it was writing is not known
            unanswered += replica.take_pending()
        else:
            replica.answered(reply.id)
        waiting = [r for r in waiting if r.pending]
    unanswered += [batch_no for r in waiting for batch_no in r.take_pending()]
    if unanswered:
        links.quarantine(ring, unanswered)
