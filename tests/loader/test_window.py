"""The request window without sockets: order, depth, replica choice, resends and what each reply means.

Replicas here are in-memory: they record what is sent to them and the test answers in any order.
The deliveries are the real ones (a socket delivery decodes the reply's frames; a ring delivery
takes a slot of a real shared-memory ring).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from libbus.errors import AuthRequired, BusError, NotFound, Unavailable
from libbus.loader.deliveries import RingDelivery, SocketDelivery
from libbus.loader.delivery_protocol import Delivery
from libbus.loader.window import (
    Arrived,
    ConnectionLost,
    Failed,
    GoingAway,
    Late,
    RequestWindow,
    SessionExpired,
    TimedOut,
)
from libbus.wire.messages import BatchResponse, Error
from shm import Ring, RingLayout


@dataclass(eq=False)
class MemoryReplica:
    """What the window needs of a replica, with the requests kept in a list instead of a socket."""

    name: str
    delivery: object
    local: bool = False
    up: bool = True
    pending: dict = field(default_factory=dict)  # request id -> batch number
    sent: list = field(default_factory=list)  # (request id, batch number, request)
    next_id: int = 1

    def send(self, batch_no: int, msg) -> None:
        self.pending[self.next_id] = batch_no
        self.sent.append((self.next_id, batch_no, msg))
        self.next_id += 1

    def answered(self, request_id: int):
        return self.pending.pop(request_id, None)

    def reply(self, request_id: int, batch_no: int) -> BatchResponse:
        x = np.full((2, 3), batch_no, dtype=np.float32)
        y = np.full(2, batch_no, dtype=np.int64)
        return BatchResponse(
            id=request_id, shapes=[[2, 3], [2]], dtypes=["float32", "int64"], nbytes=32, frames=[x.data, y.data]
        )


def window_of(count: int) -> RequestWindow:
    return RequestWindow(count, lambda n, fields: {"batch": n, **fields})


def drain(window: RequestWindow, replicas: list[MemoryReplica], inflight: int, answer) -> list[int]:
    """Run the window to the end, answering through ``answer(replicas)``; the batch numbers yielded."""
    out = []
    while not window.finished:
        window.fill(replicas, inflight)
        assert window.next_send - window.next_yield <= inflight
        taken = window.take()
        if taken is not None:
            batch_no, delivery, item = taken
            x, y = delivery.hand_out(batch_no, item)
            assert int(y[0]) == batch_no
            out.append(batch_no)
            window.advance(delivery)
            continue
        replica, rid = answer(replicas)
        outcome = window.classify(replica, replica.reply(rid, replica.pending[rid]))
        assert isinstance(outcome, Arrived)
        window.arrived(outcome.batch_no, outcome.reply)
    return out


def newest_first(replicas):
    """Answer the most recently sent request first: replies come back out of order."""
    replica = max((r for r in replicas if r.pending), key=lambda r: max(r.pending))
    return replica, max(replica.pending)


def test_batches_come_out_in_order_whatever_order_replies_arrive_in():
    socket = SocketDelivery(torch.device("cpu"))
    replicas = [MemoryReplica("a", socket), MemoryReplica("b", socket)]
    assert drain(window_of(9), replicas, 3, newest_first) == list(range(9))
    # each batch was requested once, spread over both replicas (fewest outstanding first)
    sent = sorted(b for r in replicas for _, b, _ in r.sent)
    assert sent == list(range(9)) and all(r.sent for r in replicas)


def test_a_same_host_replica_is_preferred_on_ties_and_a_down_one_gets_nothing():
    socket = SocketDelivery(torch.device("cpu"))
    remote, local, down = MemoryReplica("r", socket), MemoryReplica("l", socket, local=True), MemoryReplica("d", socket)
    down.up = False
    window = window_of(3)
    window.fill([remote, local, down], 3)
    assert [b for _, b, _ in local.sent] == [0, 2] and [b for _, b, _ in remote.sent] == [1] and not down.sent


def test_batches_sent_again_go_before_new_ones_and_leave_their_ring_slot():
    ring = RingDelivery(Ring.create(RingLayout.for_batch(3, 64, 64)), torch.device("cpu"))
    socket = SocketDelivery(torch.device("cpu"))
    try:
        local = MemoryReplica("local", ring, local=True)
        window = window_of(6)
        window.fill([local], 2)
        assert [b for _, b, _ in local.sent] == [0, 1]
        assert [m["slot"] for _, _, m in local.sent] == [0, 1]  # each request names its slot
        # the local provider fails: its batches go to a remote replica, their slots are free again
        local.up = False
        failed = sorted(local.pending.values())
        local.pending.clear()
        remote = MemoryReplica("remote", socket)
        window.resend(failed)
        window.fill([local, remote], 2)
        assert [(b, "slot" in m) for _, b, m in remote.sent] == [(0, False), (1, False)]
        assert sorted(ring.free) == [0, 1, 2]
        assert drain(window, [local, remote], 2, newest_first) == list(range(6))
    finally:
        ring.close()


def test_each_reply_is_an_explicit_outcome():
    socket = SocketDelivery(torch.device("cpu"))
    replica = MemoryReplica("a", socket)
    window = window_of(4)
    window.fill([replica], 4)
    assert isinstance(window.classify(None, None, [replica]), TimedOut)
    assert window.classify(None, None, [replica]).overdue == (replica,)
    assert window.classify(replica, None) == ConnectionLost(replica)
    assert isinstance(window.classify(replica, replica.reply(99, 0)), Late)  # never sent (or sent again)
    expired = window.classify(replica, Error(id=1, code=AuthRequired.code, message="who are you"))
    assert expired == SessionExpired(replica, 0)
    replica.send(0, {"batch": 0})  # sent again; a second AUTH_REQUIRED for it is an error to raise
    again = window.classify(replica, Error(id=5, code=AuthRequired.code, message="still not"))
    assert isinstance(again, Failed) and again.batch_no == 0
    assert window.classify(replica, Error(id=2, code=Unavailable.code, message="bye")) == GoingAway(replica, 1, "bye")
    failed = window.classify(replica, Error(id=3, code=NotFound.code, message="no such dataset"))
    assert isinstance(failed, Failed) and failed.batch_no == 2
    arrived = window.classify(replica, replica.reply(4, 3))
    assert isinstance(arrived, Arrived) and arrived.batch_no == 3


def test_a_malformed_reply_is_a_bus_error_not_a_batch():
    socket = SocketDelivery(torch.device("cpu"))
    replica = MemoryReplica("a", socket)
    window = window_of(1)
    window.fill([replica], 1)
    bad = BatchResponse(id=1, shapes=[[2, 3], [2]], dtypes=["float32", "int64"], nbytes=0, frames=[b"x"])
    outcome = window.classify(replica, bad)
    with pytest.raises(BusError, match="malformed BatchResponse"):
        window.arrived(outcome.batch_no, outcome.reply)


def test_both_transports_implement_the_delivery_protocol():
    ring = RingDelivery(Ring.create(RingLayout.for_batch(2, 8, 8)), torch.device("cpu"))
    try:
        assert isinstance(ring, Delivery) and isinstance(SocketDelivery(torch.device("cpu")), Delivery)
        assert not isinstance(object(), Delivery)
    finally:
        ring.close()
