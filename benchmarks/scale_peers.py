"""The simulated peers of :mod:`benchmarks.scale`: trainers and providers as raw DEALER sockets.

A worker process plays its share of them on one poller (no torch, no threads): every peer says ``Hello``
(the PLAIN handshake and the token, as the real ones do) and heartbeats at the interval the router's
``Welcome`` names; providers announce datasets and read the ``Entitlements`` pushed to them; trainers
``Resolve`` their dataset, then loop ``GetTask`` → ``Progress`` × N → ``PushResult``. Each worker
reports the time every timed request waited for its reply.
"""

from __future__ import annotations

import os
import random
import resource
import time
from collections import defaultdict

import zmq

from libbus.jobs.state import JobState
from libbus.security.admission import admit_client
from libbus.wire.messages import (
    Entitlements,
    Error,
    GetTask,
    Heartbeat,
    Hello,
    Progress,
    PushResult,
    Resolve,
    Task,
    Welcome,
    decode,
)
from libbus.wire.sockets import make_socket, send_message

__all__ = ["TIMED", "raise_nofile", "run_worker"]

#: The messages whose reply times are reported.
TIMED = ("GetTask", "Resolve", "Progress", "PushResult")


def raise_nofile() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit (a thousand connections need more than 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def dataset_info(name: str) -> dict:
    """What every simulated provider of ``name`` announces (replicas must agree)."""
    return {
        "name": name,
        "splits": {"train": {"num_samples": 60000}, "val": {"num_samples": 0}},
        "features": {"x": {"dtype": "float32", "shape": [1, 28, 28]}, "y": {"dtype": "int64", "shape": []}},
    }


# -- one simulated peer ----------------------------------------------------------------------------------


class Peer:
    """One simulated trainer or provider: a DEALER socket and what it is waiting for."""

    def __init__(self, ctx: zmq.Context, endpoint: str, role: str, name: str, token: str, caps: dict):
        self.sock = make_socket(ctx, zmq.DEALER)
        admit_client(self.sock, token)
        self.sock.connect(endpoint)
        self.role, self.name, self.token, self.caps = role, name, token, caps
        self.next_id = 1
        self.waiting: tuple[int, str, float] | None = None  # (request id, type, sent at)
        self.beat_s = 1.0
        self.next_beat = 0.0
        self.wake = 0.0  # a trainer's next action (between progress reports, after NoTask)
        self.job = ""
        self.reports = 0
        self.dataset = ""
        self.resolved = False
        self.welcomed = False

    def send(self, msg, now: float) -> None:
        msg.id = self.next_id
        self.next_id += 1
        self.waiting = (msg.id, msg.type, now)
        send_message(self.sock, msg)

    def hello(self, now: float) -> None:
        self.send(
            Hello(role=self.role, name=self.name, token=self.token, host_id="scale", pid=os.getpid(), caps=self.caps),
            now,
        )


class Worker:
    """A share of the simulated peers on one poller, in one process."""

    def __init__(self, args: dict, endpoint: str, tokens: list[tuple[str, str, str]], shared, stop_at: int):
        self.args = args
        self.providers_up = shared[1]  # trainers start once every provider has registered
        self.ctx = zmq.Context()
        self.finished = shared[0]  # shared count of jobs pushed as succeeded
        self.stop_at = stop_at
        self.times: dict[str, list[float]] = defaultdict(list)
        self.sent_at: dict[str, list[float]] = defaultdict(list)  # when each timed request went, from the start
        self.counts: dict[str, int] = defaultdict(int)
        self.peers: list[Peer] = []
        for role, name, token in tokens:
            if role == "provider":
                ds = f"sim-{int(name.rsplit('-', 1)[1]) % args['datasets']}"
                caps = {"endpoint": f"tcp://127.0.0.1:1/{name}", "datasets": {ds: dataset_info(ds)}, "heartbeat": True}
            else:
                caps = {"heartbeat": True}
            self.peers.append(Peer(self.ctx, endpoint, role, name, token, caps))
        self.by_sock = {p.sock: p for p in self.peers}
        self.rng = random.Random(f"{args['seed']}-{tokens[0][1] if tokens else ''}")  # one stream per worker

    def step_s(self) -> float:
        """A trainer's time to its next report: ``step_ms``, or drawn within ``±jitter`` of it (trainers
        whose jobs take different times, as on a real cluster, rather than all in lockstep)."""
        jitter = self.args["jitter"]
        return self.args["step_ms"] / 1000 * (1 + jitter * (2 * self.rng.random() - 1))

    def run(self, deadline: float) -> None:
        poller = zmq.Poller()
        now = time.monotonic()
        for i, p in enumerate(self.peers):
            poller.register(p.sock, zmq.POLLIN)
            p.next_beat = now + p.beat_s * (i % 97) / 97  # spread the beats over the interval
            p.hello(now)
        while time.monotonic() < deadline:
            with self.finished.get_lock():
                if self.finished.value >= self.stop_at:
                    break
            for sock, _ in poller.poll(20):
                peer = self.by_sock[sock]
                for _ in range(16):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self.on_reply(peer, decode(frames), time.monotonic())
            now = time.monotonic()
            for p in self.peers:
                if now >= p.next_beat and p.welcomed:
                    p.next_beat = now + p.beat_s
                    send_message(p.sock, Heartbeat(stats={}))
                if p.waiting is None and now >= p.wake:
                    if p.role == "trainer":
                        if self.providers_up.value >= self.args["providers"]:
                            self.act(p, now)
                    elif not p.welcomed:  # a provider whose session the router dropped says Hello again
                        p.hello(now)
        for p in self.peers:
            p.sock.close(0)
        self.ctx.term()

    def on_reply(self, p: Peer, msg, now: float) -> None:
        if isinstance(msg, Heartbeat | Entitlements) or (p.waiting is None or msg.id != p.waiting[0]):
            self.counts[f"push {msg.type}"] += 1
            if isinstance(msg, Error) and msg.code == "AUTH_REQUIRED":  # a heartbeat of a dropped session
                p.welcomed = False
            return
        _, kind, sent = p.waiting
        p.waiting = None
        if kind in TIMED:
            self.times[kind].append(now - sent)
            self.sent_at[kind].append(sent - self.args["t0"])
        if isinstance(msg, Error):
            self.counts[f"error {kind} {msg.code}"] += 1
            p.wake = now + 1.0
            p.job = ""
            if kind == "Hello" or msg.code == "AUTH_REQUIRED":
                p.welcomed = False
            return
        if isinstance(msg, Welcome):
            p.beat_s = msg.heartbeat_ms / 1000
            p.welcomed = True
            if p.role == "provider" and not p.resolved:  # (a provider's first Welcome)
                p.resolved = True
                with self.providers_up.get_lock():
                    self.providers_up.value += 1
        elif isinstance(msg, Task):
            p.job, p.reports = msg.job, 0
            p.wake = now + self.step_s()
        elif kind == "GetTask":  # NoTask: ask again when told
            p.wake = now + getattr(msg, "retry_ms", 1000) / 1000
        elif kind == "Progress":
            p.reports += 1
            p.wake = now + self.step_s()
        elif kind == "PushResult":
            p.job = ""
            with self.finished.get_lock():
                self.finished.value += 1
        elif kind == "Resolve":
            p.resolved = True

    def act(self, p: Peer, now: float) -> None:
        """A trainer's next request: resolve once, then ask for work, report, finish."""
        if not p.welcomed:
            p.hello(now)
        elif not p.resolved:
            p.send(Resolve(dataset=f"sim-{int(p.name.rsplit('-', 1)[1]) % self.args['datasets']}"), now)
        elif not p.job:
            p.send(GetTask(key=f"{p.name}-{p.next_id}"), now)
        elif p.reports < self.args["progress"]:
            progress = {"epoch": 1, "epochs": 1, "step": p.reports + 1, "loss": 0.5, "samples": 64 * (p.reports + 1)}
            p.send(Progress(job=p.job, progress=progress), now)
        else:
            p.send(PushResult(job=p.job, state=JobState.SUCCEEDED, result={"val_accuracy": 0.9}), now)


def run_worker(args: dict, endpoint: str, tokens, shared, stop_at: int, deadline: float, out) -> None:
    raise_nofile()
    if args.get("cores"):
        os.sched_setaffinity(0, args["cores"])
    w = Worker(args, endpoint, tokens, shared, stop_at)
    w.run(deadline)
    out.put({"times": dict(w.times), "sent_at": dict(w.sent_at), "counts": dict(w.counts)})
