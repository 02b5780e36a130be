"""Heartbeats only where they are needed (libbus/serve/server.py ``_heartbeat``, libbus/serve/sessions.py ``beat_due``):
a session sent anything within the interval gets no heartbeat, since a peer takes any message as a
sign of life (libbus/connect/link.py ``last_recv``). An idle session still gets its beats and is kept; a busy
one gets none, and a busy Link whose only news from the server are replies does not reconnect."""

from __future__ import annotations

import os
import threading
import time

import pytest
import zmq

from libbus.connect.client import Identity
from libbus.connect.link import Link
from libbus.security.admission import admit_client
from libbus.security.auth import Claims
from libbus.serve.handler import Handler, ServerConfig
from libbus.serve.server import Server
from libbus.serve.sessions import Session, SessionTable
from libbus.wire.messages import Heartbeat, Hello, Ok, Stats, Welcome, decode
from libbus.wire.sockets import make_socket, send_message

BEAT_MS = 300


class _Echo(Handler):
    roles = {"Stats": ("trainer",)}

    def handle(self, session, msg):
        return Ok()


@pytest.fixture
def server(secret):
    config = ServerConfig(bind="tcp://127.0.0.1:0", secret=secret, audience="batchbus", name="beats")
    config.heartbeat_ms = BEAT_MS
    srv = Server(_Echo(), config)
    srv.bind()
    stop = threading.Event()
    thread = threading.Thread(target=srv.run, args=(stop,), daemon=True)
    thread.start()
    yield srv
    stop.set()
    thread.join(10)


class _Peer:
    """A bare DEALER that says Hello with ``caps.heartbeat`` and counts what it is sent."""

    def __init__(self, ctx: zmq.Context, endpoint: str, token: str, name: str):
        self.sock = make_socket(ctx, zmq.DEALER)
        admit_client(self.sock, token)
        self.sock.connect(endpoint)
        self.next_id, self.beats, self.replies = 2, 0, 0
        send_message(
            self.sock, Hello(id=1, role="trainer", name=name, token=token, pid=os.getpid(), caps={"heartbeat": True})
        )
        assert self.sock.poll(5000) and isinstance(decode(self.sock.recv_multipart(copy=False)), Welcome)

    def send(self, msg) -> None:
        msg.id, self.next_id = self.next_id, self.next_id + 1
        send_message(self.sock, msg)

    def read(self) -> None:
        while self.sock.poll(0):
            msg = decode(self.sock.recv_multipart(copy=False))
            self.beats += isinstance(msg, Heartbeat)
            self.replies += isinstance(msg, Ok)


def test_an_idle_session_gets_its_beats_and_a_busy_one_none(server, make_token):
    ctx = zmq.Context()
    idle = _Peer(ctx, server.endpoint, make_token(sub="idle"), "idle")
    busy = _Peer(ctx, server.endpoint, make_token(sub="busy"), "busy")
    try:
        end = time.monotonic() + 8 * BEAT_MS / 1000
        next_beat = 0.0
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_beat:  # both peers heartbeat, as Links do
                idle.send(Heartbeat(stats={}))
                busy.send(Heartbeat(stats={}))
                next_beat = now + BEAT_MS / 1000
            busy.send(Stats())  # a request every 30 ms, each answered
            time.sleep(0.03)
            idle.read()
            busy.read()
        assert busy.replies > 50
        assert idle.beats >= 4, idle.beats  # ~8 intervals: the idle peer hears the server beat
        assert busy.beats <= 1 < idle.beats, (busy.beats, idle.beats)  # the replies were its beats
        assert {s.name for s in server.sessions.values()} == {"idle", "busy"}  # nobody was dropped
        idle.send(Stats())
        assert idle.sock.poll(5000) and isinstance(decode(idle.sock.recv_multipart(copy=False)), Ok)
    finally:
        idle.sock.close(0)
        busy.sock.close(0)
        ctx.term()


def test_a_beat_is_due_only_to_a_heartbeating_session_sent_nothing_for_an_interval():
    table = SessionTable()
    claims = Claims(sub="t", role="trainer", aud="batchbus", iss="batchbus", exp=time.time() + 60, iat=0, jti="j")
    now = 1000.0

    def session(sid: str, heartbeat: bool, last_sent: float) -> Session:
        s = Session(sid, sid.encode(), claims, Hello(role="trainer", name=sid, token=""), 0.0, now, heartbeat)
        s.last_sent = last_sent
        table.add(s)
        return s

    session("quiet", True, now - 1.5)
    session("answered", True, now - 0.2)
    session("loader", False, now - 9.0)  # no heartbeat capability: idle expiry applies, never beats
    assert [s.sid for s in table.beat_due(now, 1.0)] == ["quiet"]
    table.sent(b"quiet", now)
    assert table.beat_due(now, 1.0) == []


def test_a_busy_link_hearing_only_replies_stays_connected(server, make_token):
    link = Link(
        server.endpoint, Identity(role="trainer", name="busy-link", token=make_token(sub="bl")), heartbeat_ms=BEAT_MS
    )
    link.start()
    try:
        assert link.wait_connected(5)
        session = link.client.session
        end = time.monotonic() + 8 * BEAT_MS / 1000  # past the link's liveness (5 silent intervals)
        while time.monotonic() < end:
            assert isinstance(link.request(Stats(), timeout_s=5), Ok)
            time.sleep(0.02)
        assert link.client.session == session and link.connected.is_set()  # never reconnected
        assert [s.name for s in server.sessions.values()] == ["busy-link"]
    finally:
        link.close()
