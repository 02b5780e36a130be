"""Push many jobs through one router and report its database size and reply times.

A ``busctl start router`` process on a fresh state directory; this process submits ``--jobs`` jobs
as an admin, then plays ``--trainers`` trainer sessions that each take a job (``GetTask``), report
progress and a checkpoint, and push its result — the router's whole job path, without training.
Then it pages through ``ListJobs`` and reads ``GetJob``. Prints per message type the median, p99
and max reply time, the database size (with its WAL) per job, and the router's RSS.

``python -m benchmarks.jobs_scale --jobs 10000``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from libbus.connect.client import Client, Identity
from libbus.jobs.state import JobState
from libbus.security.auth import ensure_secret, issue_token
from libbus.wire.messages import Checkpointed, GetJob, GetTask, ListJobs, Progress, PushResult, SubmitJob, Task

REPO = Path(__file__).resolve().parents[1]
BUSCTL = [sys.executable, "-c", "from cli.app import main; main()"]


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=10_000)
    p.add_argument("--trainers", type=int, default=4)
    p.add_argument("--progress", type=int, default=3, help="progress reports per job")
    args = p.parse_args(argv)
    state = Path(tempfile.mkdtemp(prefix="batchbus-scale-"))
    ensure_secret(state / "secret")
    secret = (state / "secret").read_bytes().strip()
    env = {**os.environ, "BATCHBUS_STATE_DIR": str(state), "BATCHBUS_HEARTBEAT_MS": "1000"}
    ready = state / "router.ep"
    log = open(state / "router.log", "w")
    router = subprocess.Popen(
        [*BUSCTL, "start", "router", "--bind", "tcp://127.0.0.1:0", "--ready-file", str(ready)],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    times: dict[str, list[float]] = defaultdict(list)
    clients: list[Client] = []
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            if router.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"router did not start; see {state}/router.log")
            time.sleep(0.05)
        endpoint = ready.read_text().strip()

        def client(role: str, name: str) -> Client:
            token = issue_token(secret, sub=name, role=role, audience="batchbus", ttl_s=24 * 3600)
            c = Client(endpoint, Identity(role=role, name=name, token=token), timeout_s=30, retries=0)
            clients.append(c)
            return c

        def timed(c: Client, msg):
            start = time.perf_counter()
            reply = c.request(msg)
            times[msg.type].append(time.perf_counter() - start)
            return reply

        admin = client("admin", "bench-admin")
        trainers = [client("trainer", f"bench-t{i}") for i in range(args.trainers)]
        spec = {"dataset": "mnist", "model": "mlp", "epochs": 2, "checkpoint_every": 10}
        started = time.monotonic()
        for i in range(args.jobs):
            timed(admin, SubmitJob(spec={**spec, "name": f"job-{i}"}))
        done = 0
        while done < args.jobs:
            for n, trainer in enumerate(trainers):
                task = timed(trainer, GetTask(key=f"{n}-{done}"))
                if not isinstance(task, Task):
                    continue
                for step in range(1, args.progress + 1):
                    timed(
                        trainer,
                        Progress(
                            job=task.job,
                            progress={"epoch": 1, "epochs": 2, "step": step * 10, "loss": 0.5, "samples": step * 640},
                        ),
                    )
                record = {
                    "path": f"/ckpt/{task.job}/step-10.safetensors",
                    "sha256": "0" * 64,
                    "step": 10,
                    "epoch": 0,
                    "cursor": {"epoch": 0, "position": 640},
                }
                timed(trainer, Checkpointed(job=task.job, checkpoint=record))
                timed(
                    trainer,
                    PushResult(
                        job=task.job,
                        state=JobState.SUCCEEDED,
                        result={"val_accuracy": 0.9, "history": [{"epoch": 1}, {"epoch": 2}]},
                    ),
                )
                done += 1
                if done >= args.jobs:
                    break
        elapsed = time.monotonic() - started
        for offset in (0, args.jobs // 2, max(0, args.jobs - 50)):
            timed(admin, ListJobs(limit=50, offset=offset))
        some = admin.request(ListJobs(limit=1)).jobs[0]["id"]
        for _ in range(20):
            timed(admin, GetJob(job=some, progress=100))
        rss = _rss_mib(router.pid)
    finally:
        for c in clients:
            c.close()
        router.terminate()
        router.wait(30)
        log.close()
    size = sum(f.stat().st_size for f in state.glob("router.db*"))
    print(
        f"jobs through one router: {args.jobs} ({args.trainers} trainer sessions, {args.progress} progress "
        f"reports + 1 checkpoint record + result each) in {elapsed:.1f} s"
    )
    print(f"{'message':<14}{'count':>8}{'median ms':>11}{'p99 ms':>9}{'max ms':>9}")
    for kind, values in sorted(times.items()):
        values.sort()
        p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
        print(
            f"{kind:<14}{len(values):>8}{1000 * statistics.median(values):>11.2f}{1000 * p99:>9.2f}"
            f"{1000 * values[-1]:>9.2f}"
        )
    print(
        f"database: {size / 2**20:.1f} MiB ({size / args.jobs / 1024:.1f} KiB per job), router RSS {rss:.0f} MiB, "
        f"state {state}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
