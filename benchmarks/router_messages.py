"""The router's handler alone: CPU per message type, with no socket and no other process.

What a wave of requests costs the router's loop, message by message: a :class:`RouterHandler` on a
fresh job database (group commit on, as ``busctl start router`` runs it), ``--providers`` provider
sessions announcing 10 datasets, ``--trainers`` trainer sessions, twice as many queued jobs as
trainers. Every trainer resolves its dataset, then twice: takes a job (``GetTask``), reports three
times (``Progress``) and finishes it (``PushResult``); the loop's timers and the turn's flush (one
commit and fsync) run every 200 messages, as a busy router's turns would. Reported per message type:
mean, p50 and max microseconds of the handler call, and the same for a turn's timers plus flush. The
server's own work per message (receive, decode, session checks, reply) is not in it: see
``benchmarks/scale.py`` for the whole router.

    python -m benchmarks.router_messages --trainers 1000 --json router_messages.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from libbus.jobs.state import JobState
from libbus.security.auth import Claims
from libbus.serve.sessions import Session
from libbus.wire.messages import GetTask, Hello, Message, Progress, PushResult, Resolve, SubmitJob
from services.router.handler import RouterHandler
from services.router.store import JobStore

from .scale_peers import dataset_info

__all__ = ["main", "run"]

DATASETS = 10
TURN = 200  # messages between two runs of the timers and the flush


class Bench:
    def __init__(self, root: Path, providers: int, trainers: int):
        self.store = JobStore(str(root / "router.db"))
        self.store.durability.group()
        self.handler = RouterHandler(self.store, lease_s=10.0)
        self.times: dict[str, list[float]] = defaultdict(list)
        self.sent = 0
        for i in range(providers):
            name = f"sim-{i % DATASETS}"
            caps = {"endpoint": f"tcp://127.0.0.1:1/{i}", "datasets": {name: dataset_info(name)}, "heartbeat": True}
            self.session("provider", f"provider-{i}", caps)
        admin = self.session("admin", "admin", {})
        for n in range(2 * trainers):
            spec = {"dataset": f"sim-{n % DATASETS}", "model": "mlp", "epochs": 1, "name": f"job-{n}"}
            self.handler.handle(admin, SubmitJob(id=1, spec=spec))
        self.handler.flush()
        self.trainers = [self.session("trainer", f"trainer-{i}", {"heartbeat": True}) for i in range(trainers)]

    def session(self, role: str, name: str, caps: dict) -> Session:
        now = time.monotonic()
        claims = Claims(sub=name, role=role, aud="batchbus", exp=time.time() + 3600, iat=0, jti=name)
        session = Session(
            sid=name,
            routing_id=name.encode(),
            claims=claims,
            hello=Hello(role=role, name=name, token="", caps=caps),
            opened=time.time(),
            last_seen=now,
            heartbeat=True,
            _tokens=1e9,
            _refilled=now,
        )
        self.handler.on_open(session)
        return session

    def call(self, session: Session, msg: Message):
        t = time.perf_counter()
        reply = self.handler.handle(session, msg)
        self.times[msg.type].append(time.perf_counter() - t)
        self.sent += 1
        if self.sent % TURN == 0:
            self.turn()
        return reply

    def turn(self) -> None:
        t = time.perf_counter()
        self.handler.tick(time.monotonic())
        self.handler.flush()
        self.handler.take_outbox()
        self.times["turn: timers + flush"].append(time.perf_counter() - t)

    def run(self) -> None:
        for i, s in enumerate(self.trainers):
            self.call(s, Resolve(id=1, dataset=f"sim-{i % DATASETS}"))
        for round_ in range(2):
            jobs = {s.sid: self.call(s, GetTask(id=1, key=f"{s.sid}-{round_}")).job for s in self.trainers}
            for step in range(1, 4):
                progress = {"epoch": 1, "epochs": 1, "step": step, "loss": 0.5, "samples": 64 * step}
                for s in self.trainers:
                    self.call(s, Progress(id=1, job=jobs[s.sid], progress=progress))
            for s in self.trainers:
                self.call(s, PushResult(id=1, job=jobs[s.sid], state=JobState.SUCCEEDED, result={"val_accuracy": 0.9}))
        self.turn()


def run(providers: int, trainers: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="batchbus-router-messages-") as root:
        bench = Bench(Path(root), providers, trainers)
        bench.run()
        bench.store.close()
    return {
        "trainers": trainers,
        "providers": providers,
        "us": {
            kind: {
                "count": len(v),
                "mean": 1e6 * statistics.mean(v),
                "p50": 1e6 * statistics.median(v),
                "max": 1e6 * max(v),
            }
            for kind, v in bench.times.items()
        },
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.router_messages", description=__doc__.split("\n\n")[0])
    p.add_argument("--trainers", type=int, default=1000)
    p.add_argument("--providers", type=int, default=100)
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    if args.trainers < 1 or args.providers < DATASETS:
        p.error(f"--trainers must be at least 1 and --providers at least {DATASETS} (one per dataset)")
    result = run(args.providers, args.trainers)
    print(f"the router's handler alone: {args.trainers} trainers, {args.providers} providers")
    print(f"{'message':<22}{'count':>7}{'mean us':>10}{'p50 us':>10}{'max us':>10}")
    for kind, v in result["us"].items():
        print(f"{kind:<22}{v['count']:>7}{v['mean']:>10.1f}{v['p50']:>10.1f}{v['max']:>10.0f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
