"""Authenticated readers that never read: a provider's memory per connection is bounded in bytes.

A peer with a valid token (a trainer token scoped to the dataset) sends many ``BatchRequest`` over
TCP and never reads the replies (its socket takes at most one message and a small TCP window). The
provider (``busctl start``, a real process) holds each reply until the peer takes it; its resident
memory (``VmRSS`` from ``/proc``) is sampled throughout. With the default settings the replies it
holds for the connection stay within ``session_unsent_bytes`` (64 MiB) plus one reply
(libbus/serve/backlog.py): later requests wait, then are refused RATE_LIMITED. With ``--no-cap``
(``session_unsent_bytes = 0``) libzmq's high-water mark, 1000 messages, is the only bound.

    python -m benchmarks.unread_replies
    python -m benchmarks.unread_replies --no-cap --requests 200
    python -m benchmarks.unread_replies --overhead   # the socket path with the bound on and off
    python -m benchmarks.unread_replies --send-cost  # one reply's send, watched or not

``--overhead`` reads ``busctl bench``'s dataset over the socket path (RemoteLoader over loopback
TCP) from one provider, with its reply tracking switched on and off between rounds, and prints the
throughput of each and their ratio.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import zmq

from benchmarks.preauth_flood import MiB, rss, start_services, stop_services
from libbus.security.admission import admit_client
from libbus.security.auth import issue_token
from libbus.wire.messages import BatchRequest, BatchResponse, Error, Hello, decode, encode

__all__ = ["attack", "run"]

#: Samples per batch: zero-filled float32 28x28 samples (cheap to serve: the provider's memory,
#: not its CPU, is what is attacked), about 1.5 MiB a reply.
BATCH = 500
DATASET = "mnist=dummy://?shape=1,28,28&n=20000"


def _token(state: Path, sub: str) -> str:
    secret = (state / "secret").read_bytes().strip()
    return issue_token(secret, sub=sub, role="trainer", audience="batchbus", datasets=["mnist"])


def _reader(endpoint: str, token: str, reads: bool) -> zmq.Socket:
    """A connected, welcomed DEALER. One that does not read takes one message at most."""
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if not reads:
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 64 * 1024)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    admit_client(sock, token)
    sock.connect(endpoint)
    sock.send_multipart(encode(Hello(id=1, role="trainer", name="reader", token=token)))
    if not sock.poll(10_000):
        raise RuntimeError(f"{endpoint} did not answer Hello")
    decode(sock.recv_multipart())
    return sock


def _batch(i: int) -> list:
    start = (i * BATCH) % (20000 - BATCH)
    return encode(BatchRequest(id=100 + i, dataset="mnist", split="train", range=[start, start + BATCH]))


def attack(endpoint: str, token: str, requests: int) -> zmq.Socket:
    """Send ``requests`` BatchRequests and read nothing; returns the socket (still unread)."""
    sock = _reader(endpoint, token, reads=False)
    for i in range(requests):
        sock.send_multipart(_batch(i))
    return sock


def run(state: Path, requests: int = 400, seconds: float = 8.0, env: dict | None = None) -> dict:
    """Start a router and a provider, let one peer request ``requests`` batches and not read them
    for ``seconds`` while another reads normally; then the first reads what came. Returns figures."""
    procs, _router, provider = start_services(state, dataset=DATASET, env=env)
    try:
        pid = procs[1].pid
        honest = _reader(provider, _token(state, "honest"), reads=True)
        honest.send_multipart(_batch(0))  # the dataset is made and the first batch allocated
        if not honest.poll(30_000):
            raise RuntimeError("the provider did not serve a first batch")
        reply_bytes = cast(BatchResponse, decode(honest.recv_multipart(copy=False))).nbytes
        time.sleep(1.0)
        before = peak = rss(pid)
        mallory = attack(provider, _token(state, "mallory"), requests)
        served = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            honest.send_multipart(_batch(served))
            if honest.poll(10_000):
                reply = decode(honest.recv_multipart(copy=False))
                served += not isinstance(reply, Error)
            peak = max(peak, rss(pid))
            time.sleep(0.05)
        outcome = {"BatchResponse": 0}
        mallory.setsockopt(zmq.RCVTIMEO, 2000)
        for _ in range(requests):  # now it reads: what did it get?
            try:
                msg = decode(mallory.recv_multipart(copy=False))
            except zmq.Again:
                break
            # errors by code and wording (figures left out, so that like ones count together)
            key = msg.type if not isinstance(msg, Error) else f"{msg.code}: " + re.sub(r"\d[\d.]*", "N", msg.message)
            outcome[key] = outcome.get(key, 0) + 1
        alive = all(p.poll() is None for p in procs)
        mallory.close(0)
        honest.close(0)
        return {
            "requested_mib": requests * reply_bytes / MiB,
            "rss_before_mib": before / MiB,
            "rss_peak_mib": peak / MiB,
            "growth_mib": (peak - before) / MiB,
            "honest_batches": served,
            "outcome": outcome,
            "alive": alive,
        }
    finally:
        stop_services(procs)


def overhead(rounds: int = 12, samples: int = 8192, batch: int = 256) -> dict:
    """GB/s of the socket path (``RemoteLoader(shm=False)``, one epoch a round) with the bound on
    and off, alternating ``rounds`` times against one router and one provider run on threads of
    this process: between rounds only the provider's tracking is switched, so nothing else
    (process start, page cache, sockets) differs between the two."""
    import shutil  # noqa: PLC0415 - only this mode starts services
    import threading  # noqa: PLC0415

    from benchmarks.delivery import make_dataset  # noqa: PLC0415
    from libbus.config import load_settings  # noqa: PLC0415
    from libbus.constants import TRACK_MIN_BYTES  # noqa: PLC0415
    from libbus.loader.remote import RemoteLoader  # noqa: PLC0415
    from libbus.security.auth import ensure_secret  # noqa: PLC0415
    from services.provider.app import ProviderService  # noqa: PLC0415
    from services.router.app import RouterService  # noqa: PLC0415

    root = Path(tempfile.mkdtemp(prefix="batchbus-unread-"))
    make_dataset(root, samples)
    state = root / "state"
    secret = ensure_secret(state / "secret")
    stop = threading.Event()
    started = []

    def start(service):
        endpoint = service.start()
        thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
        thread.start()
        started.append(thread)
        return endpoint

    def settings(**flags):
        return load_settings(env={}, flags={"state_dir": str(state), "log_level": "WARNING", **flags})[0]

    rates: dict[str, list[float]] = {"on": [], "off": []}
    try:
        router = start(RouterService(settings(bind="tcp://127.0.0.1:0")))
        ram = f"ram=file://{root}?memory=ram&val_fraction=0"
        provider = ProviderService(settings(router=router, datasets=[ram], assigned_only=False))
        endpoint = start(provider)
        token = issue_token(secret, sub="bench", role="trainer", audience="batchbus", datasets=["ram"])
        sample_bytes = sum(np.load(root / f"train_{k}.npy", mmap_mode="r")[0].nbytes for k in "xy")
        for r in range(rounds):
            for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
                provider.server._track_min = TRACK_MIN_BYTES if mode == "on" else None
                kw: dict[str, Any] = {
                    "batch_size": batch,
                    "inflight": 4,
                    "shm": False,
                    "shuffle": "full",
                    "drop_last": True,
                }
                with RemoteLoader("ram", provider=endpoint, token=token, **kw) as loader:
                    t0, n = time.perf_counter(), 0
                    for _ in loader:
                        n += 1
                    rates[mode].append(n * batch * sample_bytes / (time.perf_counter() - t0) / 1e9)
    finally:
        stop.set()
        for thread in started:
            thread.join(15)
        shutil.rmtree(root, ignore_errors=True)
    return rates


def send_cost(blocks: int = 20, n: int = 300) -> dict:
    """Microseconds to send one reply (a 3 MiB batch, and a 24 KiB one made of small frames) from a
    ROUTER to a reading DEALER over loopback TCP, watched (the bound on) or not, alternating blocks
    of ``n`` sends in one process. Medians over ``blocks``."""
    import threading  # noqa: PLC0415

    from libbus.wire.messages import BatchResponse  # noqa: PLC0415
    from libbus.wire.sockets import send_tracked  # noqa: PLC0415

    ctx = zmq.Context()
    server, reader = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    server.setsockopt(zmq.SNDHWM, 0)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    reader.connect(f"tcp://127.0.0.1:{port}")
    reader.send(b"hi")
    routing_id = server.recv_multipart()[0]
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            if reader.poll(50):
                reader.recv_multipart(copy=False)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    out: dict = {}
    try:
        for label, samples, shape in (("3 MiB", 256, (3, 32, 32)), ("24 KiB", 24, (256,))):
            x, y = np.zeros((samples, *shape), np.float32), np.zeros(samples, np.int64)
            reply = BatchResponse(
                shapes=[list(x.shape), list(y.shape)], dtypes=[x.dtype.str, y.dtype.str], nbytes=x.nbytes + y.nbytes
            )
            times: dict[str, list[float]] = {"on": [], "off": []}
            for b in range(blocks):
                for mode in ("on", "off") if b % 2 == 0 else ("off", "on"):
                    track = 16 * 1024 if mode == "on" else None
                    t0 = time.perf_counter()
                    for _ in range(n):
                        reply.frames = [x.data, y.data]
                        send_tracked(server, reply, routing_id, track)
                    times[mode].append((time.perf_counter() - t0) / n * 1e6)
            out[label] = {mode: float(np.median(v)) for mode, v in times.items()}
    finally:
        stop.set()
        thread.join()
        reader.close(0)
        server.close(2000)
        ctx.term()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400, help="BatchRequests the reader sends and does not read")
    ap.add_argument("--seconds", type=float, default=20.0, help="how long it does not read")
    ap.add_argument("--no-cap", action="store_true", help="run the provider with session_unsent_bytes = 0")
    ap.add_argument("--overhead", action="store_true", help="socket-path throughput with the bound on and off")
    ap.add_argument("--send-cost", action="store_true", help="microseconds per reply sent, watched or not")
    args = ap.parse_args()
    if args.send_cost:
        for label, r in send_cost().items():
            print(f"{label} reply: {r['on']:.1f} us watched, {r['off']:.1f} us not (on/off {r['on'] / r['off']:.3f})")
        return
    if args.overhead:
        rates = overhead()
        on, off = float(np.median(rates["on"])), float(np.median(rates["off"]))
        pairs = [a / b for a, b in zip(rates["on"], rates["off"], strict=True)]
        geo = float(np.exp(np.mean(np.log(pairs))))
        print("socket path (RemoteLoader over loopback TCP), GB/s per round, bound on / off:")
        print("  " + ", ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(rates["on"], rates["off"], strict=True)))
        print(
            f"  median on {on:.3f} GB/s, off {off:.3f} GB/s: on/off {on / off:.3f}; geometric mean of rounds {geo:.3f}"
        )
        return
    env = {"BATCHBUS_SESSION_UNSENT_BYTES": "0"} if args.no_cap else {}
    with tempfile.TemporaryDirectory() as tmp:
        out = run(Path(tmp), args.requests, args.seconds, env)
    print(
        f"{'session_unsent_bytes = 0' if args.no_cap else 'default settings'}: one reader asked for "
        f"{args.requests} batches ({out['requested_mib']:.0f} MiB) and read nothing for {args.seconds:.0f} s"
    )
    print(
        f"  provider resident {out['rss_before_mib']:.0f} MiB before, {out['rss_peak_mib']:.0f} MiB at peak "
        f"(+{out['growth_mib']:.1f} MiB); another reader got {out['honest_batches']} batches meanwhile"
    )
    print(f"  what the reader found when it read: {out['outcome']}")
    print(f"  provider alive: {out['alive']}")


if __name__ == "__main__":
    main()
