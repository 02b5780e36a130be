"""Replies a peer does not read are bounded in bytes per connection. Real provider processes and sockets; resident memory is sampled from /proc."""

from __future__ import annotations

import time

import numpy as np
import zmq

from benchmarks.unread_replies import run
from libbus.constants import MiB
from libbus.loader.remote import RemoteLoader
from libbus.security.admission import admit_client
from libbus.serve.backlog import Backlogs
from libbus.wire.messages import BatchRequest, Goodbye, Hello, Ok, encode
from libbus.wire.sockets import SentTracker, send_tracked

#: What a connection that reads nothing may cost a provider under the default settings:
#: ``session_unsent_bytes`` (64 MiB) plus the one ~1.5 MiB reply that crossed it, plus small untracked
#: replies and allocator slack. Without the bound the same attack grows by what it asked for.
UNREAD_BOUND_MIB = 80


def test_a_reader_that_never_reads_costs_the_provider_a_bounded_amount(tmp_path):
    # 300 batches of ~1.5 MiB asked for, nothing read for 3 s (its requests wait 1 s, then are refused)
    out = run(tmp_path / "state", requests=300, seconds=3.0, env={"BATCHBUS_UNSENT_WAIT_S": "1"})
    assert out["alive"]
    assert out["requested_mib"] > 4 * UNREAD_BOUND_MIB, out
    assert out["growth_mib"] <= UNREAD_BOUND_MIB, f"the provider grew by {out['growth_mib']:.0f} MiB: {out}"
    # another reader was served all along, and the attacker, when it finally reads, finds why it got
    # only part of what it asked for
    assert out["honest_batches"] > 0
    outcome = out["outcome"]
    assert 0 < outcome["BatchResponse"] < 300
    refused = {k: v for k, v in outcome.items() if k.startswith("RATE_LIMITED")}
    assert any("still unread" in k and "(session_unsent_bytes)" in k for k in refused), outcome
    assert sum(outcome.values()) == 300, outcome


def test_a_loader_reading_through_a_tiny_budget_gets_every_batch(start_provider, make_token):
    # a budget below one batch: every request waits for the previous reply to leave, and the
    # loader still gets every sample, in order, as with no budget at all
    provider = start_provider("zeros=dummy://?shape=64,64&n=512&classes=4", session_unsent_bytes=1024)
    loader = RemoteLoader(
        "zeros",
        token=make_token("trainer"),
        provider=provider.endpoint,
        batch_size=64,
        shuffle=False,
        inflight=8,
        shm=False,
    )
    batches = list(loader)
    assert sum(len(x) for x, _ in batches) == 512
    assert all(np.asarray(x).shape[1:] == (64, 64) for x, _ in batches)
    backlog = provider.service.server.backlog.stats()
    assert backlog["deferred_for_reads"] > 0 and backlog["refused_unread"] == 0


def test_a_tracked_reply_is_done_only_once_the_peer_has_taken_it():
    ctx = zmq.Context.instance()
    server = ctx.socket(zmq.ROUTER)
    reader = ctx.socket(zmq.DEALER)
    try:
        port = server.bind_to_random_port("tcp://127.0.0.1")
        reader.setsockopt(zmq.RCVHWM, 1)  # takes one message at a time, with a small TCP window
        reader.setsockopt(zmq.RCVBUF, 64 * 1024)
        reader.connect(f"tcp://127.0.0.1:{port}")
        reader.send(b"hi")
        routing_id, _ = server.recv_multipart()
        big = np.zeros(MiB, np.uint8)
        sent = [send_tracked(server, Ok(id=i + 1, frames=[big.data]), routing_id, 16 * 1024) for i in range(40)]
        small = send_tracked(server, Ok(id=99, frames=[b"x" * 100]), routing_id, 16 * 1024)  # not tracked
        assert all(ok for ok, _, _ in sent) and small[1] is None
        time.sleep(0.5)
        held = [t for _, t, _ in sent if not t.done]
        assert len(held) > 30  # the kernel buffers a few MiB; the rest waits in libzmq, and is counted
        for _ in range(40):  # the reader takes everything: every reply has left
            assert reader.poll(5000)
            reader.recv_multipart()
        deadline = time.monotonic() + 5
        while not all(t.done for _, t, _ in sent):
            assert time.monotonic() < deadline, "replies taken by the reader still counted as held"
            time.sleep(0.01)
    finally:
        reader.close(0)
        server.close(0)


def test_waiting_requests_of_a_reader_that_leaves_are_dropped(start_provider, make_token, client_for):
    provider = start_provider("zeros=dummy://?shape=64,64&n=4096&classes=4", session_unsent_bytes=1024)
    token = make_token("trainer", sub="leaver")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 64 * 1024)
    admit_client(sock, token)
    sock.connect(provider.endpoint)
    try:
        sock.send_multipart(encode(Hello(id=1, role="trainer", name="leaver", token=token)))
        assert sock.poll(5000)
        sock.recv_multipart()
        for i in range(40):  # 1 MiB each, never read: past the first few, they wait
            request = BatchRequest(id=10 + i, dataset="zeros", split="train", range=[i * 64, i * 64 + 64])
            sock.send_multipart(encode(request))
        server = provider.service.server
        deadline = time.monotonic() + 10
        while server.backlog.stats()["waiting_for_reads"] == 0:
            assert time.monotonic() < deadline, server.backlog.stats()
            time.sleep(0.05)
        sock.send_multipart(encode(Goodbye()))
        while server.backlog.stats()["waiting_for_reads"]:
            assert time.monotonic() < deadline, "a closed session's waiting requests were kept"
            time.sleep(0.05)
    finally:
        sock.close(0)
    # everyone else is served as before
    other = client_for(provider.endpoint, token=make_token("trainer", sub="other"))
    assert other.request(BatchRequest(dataset="zeros", split="train", range=[0, 8])).nbytes > 0


def test_reading_the_stats_never_changes_a_ledger_the_serving_loop_is_settling():
    """Heartbeats and metric scrapes read a server's stats from threads of their own. A read that
    settled the ledger (as it once did) raced the serving loop's own settle: both saw a reply left,
    both popped it, and the loop died of "pop from an empty deque" (a fuzz run found it). A read
    now leaves the ledger as it is; only the loop settles it."""
    backlogs = Backlogs(budget=MiB, wait_s=1.0)
    sent = bytearray(100)
    tracker = SentTracker(memoryview(sent))  # already released: libzmq kept no reference
    backlogs.track(b"peer", tracker, 100)
    assert tracker.done
    assert backlogs.stats()["unsent_bytes"] == 100  # as the loop last saw it
    assert backlogs.unsent(b"peer") == 0  # the loop's settle finds the reply gone, once
    assert backlogs.stats()["unsent_bytes"] == 0
