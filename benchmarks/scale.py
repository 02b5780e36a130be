"""The router at scale: a thousand trainers and a hundred providers as lightweight wire clients.

A ``busctl start router`` process on a fresh state directory; this process submits ``--jobs`` jobs as
an admin (several requests in flight), then ``--procs`` worker processes each play their share of
``--trainers`` trainers and ``--providers`` providers as raw DEALER sockets on one poller (no torch,
no threads): every peer says ``Hello`` (the PLAIN handshake and the token, as the real ones do) and
heartbeats at the interval the router's ``Welcome`` names; providers announce datasets and read the
``Entitlements`` the router pushes them; trainers ``Resolve`` their dataset, then loop ``GetTask`` →
``--progress`` × ``Progress`` (``--step-ms`` apart) → ``PushResult`` until every job is done.

Reported: the router's CPU seconds (user + system, from ``/proc/PID/stat``) over the job phase and
as a fraction of one core, its resident memory, the database size (with its WAL), and p50/p99/max of
the time each trainer waited for the reply to ``GetTask``, ``Resolve``, ``Progress`` and
``PushResult``. The latencies include the worker processes' own turn on this machine's cores; the
router's CPU seconds do not depend on how busy the machine is.

The simulated peers are in :mod:`benchmarks.scale_peers`. Every socket is a file descriptor in the router (and two in a worker); the workers raise their own
soft ``RLIMIT_NOFILE`` to the hard limit, and the router is started with it raised too.

    python -m benchmarks.scale --trainers 1000 --providers 100 --jobs 10000 --json scale.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import zmq

from libbus.connect.client import Client, Identity
from libbus.jobs.state import JobState
from libbus.security.admission import admit_client
from libbus.security.auth import ensure_secret, issue_token
from libbus.wire.messages import (
    Error,
    Hello,
    JobSubmitted,
    Stats,
    SubmitJob,
    Welcome,
    decode,
)
from libbus.wire.sockets import make_socket, send_message

from .scale_peers import TIMED, raise_nofile, run_worker

__all__ = ["main", "run"]

REPO = Path(__file__).resolve().parents[1]
BUSCTL = [sys.executable, "-c", "from cli.app import main; main()"]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (``/proc/PID/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _start_router_proc(cores: set[int] | None) -> None:
    """In the router's process before exec: more file descriptors, and its cores (inherited by
    every thread it starts: the loop, libzmq's I/O thread, the handshake's ZAP thread)."""
    raise_nofile()
    if cores:
        os.sched_setaffinity(0, cores)


def _pinned(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """``--pin``: the router alone on the first usable core, the simulated peers on the others,
    as on a cluster, where the router has its host's cores and every trainer runs elsewhere."""
    if not pin:
        return None, None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--pin needs at least two usable cores")
    return {cores[0]}, set(cores[1:])


# -- the run -------------------------------------------------------------------------------------------


class Router:
    """A ``busctl start router`` process on a fresh state directory."""

    def __init__(self, state: Path, profile: Path | None = None, cores: set[int] | None = None):
        self.state = state
        secret = ensure_secret(state / "secret")
        self.secret = secret
        env = {**os.environ, "BATCHBUS_STATE_DIR": str(state)}
        ready = state / "router.ep"
        self.log = open(state / "router.log", "w")
        cmd = [sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "cli"] if profile else BUSCTL
        self.proc = subprocess.Popen(
            [*cmd, "start", "router", "--bind", "tcp://127.0.0.1:0", "--ready-file", str(ready)],
            cwd=REPO,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: _start_router_proc(cores),
        )
        deadline = time.monotonic() + 60
        while not ready.exists() or not ready.read_text().strip():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"router did not start; see {state}/router.log")
            time.sleep(0.05)
        self.endpoint = ready.read_text().strip()

    def token(self, role: str, name: str) -> str:
        return issue_token(self.secret, sub=name, role=role, audience="batchbus", ttl_s=24 * 3600)

    def db_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.state.glob("router.db*"))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def submit(router: Router, jobs: int, datasets: int, window: int = 32) -> None:
    """``jobs`` jobs from one admin session, ``window`` requests in flight."""
    ctx: zmq.Context = zmq.Context.instance()
    sock = make_socket(ctx, zmq.DEALER)
    token = router.token("admin", "scale-admin")
    admit_client(sock, token)
    sock.connect(router.endpoint)
    try:
        send_message(sock, Hello(id=1, role="admin", name="scale-admin", token=token, pid=os.getpid()))
        if not isinstance(_recv(sock), Welcome):
            raise SystemExit("the router refused the admin's Hello")
        sent = done = 0
        spec = lambda n: {"dataset": f"sim-{n % datasets}", "model": "mlp", "epochs": 1, "name": f"job-{n}"}  # noqa: E731
        while done < jobs:
            while sent < jobs and sent - done < window:
                send_message(sock, SubmitJob(id=sent + 2, spec=spec(sent)))
                sent += 1
            reply = _recv(sock)
            if isinstance(reply, Error) and reply.code == "RATE_LIMITED":  # faster than a session may ask
                time.sleep(0.05)
                send_message(sock, SubmitJob(id=reply.id, spec=spec(reply.id - 2)))
                continue
            if not isinstance(reply, JobSubmitted):
                raise SystemExit(f"SubmitJob refused: {reply}")
            done += 1
    finally:
        sock.close(0)


def watch(router: Router, procs: list, finished, stop_at: int) -> dict:
    """Every 2 s, the router's job counts; once none is queued, running or paused (some may have
    failed: lost three times), tell the workers to stop. Returns the last counts by state."""
    token = router.token("admin", "scale-watch")
    with Client(router.endpoint, Identity(role="admin", name="scale-watch", token=token), timeout_s=60) as admin:
        while any(p.is_alive() for p in procs):
            time.sleep(2)
            counts = admin.request(Stats()).services["router"]["jobs"]
            if not any(counts.get(state, 0) for state in (JobState.QUEUED, JobState.RUNNING, JobState.PAUSED)):
                with finished.get_lock():
                    finished.value = max(finished.value, stop_at)  # the workers' signal to stop
                break
        return admin.request(Stats()).services["router"]["jobs"]


def _recv(sock: zmq.Socket, timeout_s: float = 60):
    if not sock.poll(int(timeout_s * 1000)):
        raise SystemExit("the router did not answer within a minute")
    return decode(sock.recv_multipart(copy=False))


def _split(items: list, n: int) -> list[list]:
    return [items[i::n] for i in range(n)]


def run(args: argparse.Namespace) -> dict:
    state = Path(tempfile.mkdtemp(prefix="batchbus-scale-"))
    router_cores, peer_cores = _pinned(args.pin)
    router = Router(state, args.profile, router_cores)
    try:
        t0 = time.monotonic()
        submit(router, args.jobs, args.datasets)
        submit_s = time.monotonic() - t0
        peers = [
            ("provider", f"sim-provider-{i}", router.token("provider", f"sim-provider-{i}"))
            for i in range(args.providers)
        ]
        peers += [
            ("trainer", f"sim-trainer-{i}", router.token("trainer", f"sim-trainer-{i}")) for i in range(args.trainers)
        ]
        ctx = multiprocessing.get_context("spawn")
        finished, providers_up = ctx.Value("l", 0), ctx.Value("l", 0)
        out = ctx.Queue()
        wargs = {
            "progress": args.progress,
            "step_ms": args.step_ms,
            "jitter": args.jitter,
            "seed": args.seed,
            "datasets": args.datasets,
            "t0": time.monotonic(),
            "providers": args.providers,
            "cores": peer_cores,
        }
        cpu0, w0 = _cpu_s(router.proc.pid), time.monotonic()
        deadline = time.time() + args.timeout
        procs = [
            ctx.Process(
                target=run_worker,
                args=(
                    wargs,
                    router.endpoint,
                    share,
                    (finished, providers_up),
                    args.jobs,
                    time.monotonic() + args.timeout,
                    out,
                ),
                daemon=True,
            )
            for share in _split(peers, args.procs)
        ]
        for p in procs:
            p.start()
        states = watch(router, procs, finished, args.jobs)
        results = [out.get(timeout=max(1.0, deadline - time.time() + 60)) for _ in procs]
        for p in procs:
            p.join(30)
        cpu = _cpu_s(router.proc.pid) - cpu0
        wall = time.monotonic() - w0
        rss = _rss_mib(router.proc.pid)
        db = router.db_bytes()
    finally:
        router.stop()
    times: dict[str, list[float]] = defaultdict(list)
    sent_at: dict[str, list[float]] = defaultdict(list)
    counts: dict[str, int] = defaultdict(int)
    for r in results:
        for k, v in r["times"].items():
            times[k] += v
            sent_at[k] += r["sent_at"][k]
        for k, v in r["counts"].items():
            counts[k] += v
    latency = {kind: _percentiles(times.get(kind, [])) for kind in TIMED}
    # the same, for requests sent after the start (every trainer's Hello, Resolve and first GetTask at once)
    settled = {
        kind: _percentiles([t for t, at in zip(times.get(kind, []), sent_at.get(kind, [])) if at >= args.settle_s])
        for kind in TIMED
    }
    result = {
        "trainers": args.trainers,
        "providers": args.providers,
        "jobs": args.jobs,
        "finished": states.get(JobState.SUCCEEDED, 0),
        "job_states": states,
        "progress_per_job": args.progress,
        "step_ms": args.step_ms,
        "jitter": args.jitter,
        "procs": args.procs,
        "pinned": args.pin,
        "submit_s": submit_s,
        "wall_s": wall,
        "router_cpu_s": cpu,
        "router_cores": cpu / wall,
        "router_rss_mib": rss,
        "db_mib": db / 2**20,
        "latency": latency,
        "settle_s": args.settle_s,
        "latency_settled": settled,
        "counts": dict(counts),
    }
    shutil.rmtree(state, ignore_errors=True)
    return result


def _percentiles(seconds: list[float]) -> dict:
    ms = np.array(seconds or [0.0]) * 1e3
    p50, p99 = np.percentile(ms, [50, 99])
    return {"count": len(seconds), "p50_ms": float(p50), "p99_ms": float(p99), "max_ms": float(ms.max())}


def print_result(r: dict) -> None:
    print(
        f"{r['trainers']} trainers, {r['providers']} providers, {r['finished']}/{r['jobs']} jobs succeeded "
        f"(by state: {r['job_states']}) "
        f"({r['progress_per_job']} progress reports {r['step_ms']:.0f} ms ±{100 * r['jitter']:.0f}% apart) in {r['wall_s']:.1f} s "
        f"(submitting took {r['submit_s']:.1f} s){'; the router pinned to a core of its own' if r['pinned'] else ''}"
    )
    print(
        f"router: {r['router_cpu_s']:.1f} CPU s = {r['router_cores']:.2f} of a core, RSS {r['router_rss_mib']:.0f} MiB; "
        f"database {r['db_mib']:.1f} MiB"
    )
    print(f"{'message':<12}{'count':>8}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    after = f"sent after the first {r['settle_s']:.0f} s (the start: every trainer's Hello, Resolve, first GetTask):"
    for kind, v in [*r["latency"].items(), ("", after), *r["latency_settled"].items()]:
        print(f"{kind:<12}{v['count']:>8}{v['p50_ms']:>9.2f}{v['p99_ms']:>9.2f}{v['max_ms']:>9.1f}" if kind else v)
    for k, v in sorted(r["counts"].items()):
        print(f"  {k}: {v}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--trainers", type=int, default=1000)
    p.add_argument("--providers", type=int, default=100)
    p.add_argument("--jobs", type=int, default=10_000)
    p.add_argument("--datasets", type=int, default=10, help="distinct dataset names the providers serve")
    p.add_argument("--progress", type=int, default=3, help="Progress reports per job")
    p.add_argument("--step-ms", type=float, default=5000.0, help="a trainer's time between reports")
    p.add_argument(
        "--jitter", type=float, default=0.0, help="each step drawn within +-this fraction of --step-ms (0: lockstep)"
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the jitter")
    p.add_argument("--procs", type=int, default=4, help="worker processes playing the peers")
    p.add_argument("--pin", action="store_true", help="the router alone on one core, the simulated peers on the others")
    p.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds")
    p.add_argument("--settle-s", type=float, default=10.0, help="latencies also reported for requests sent after this")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--profile", type=Path, help="run the router under cProfile, its stats written here")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if min(args.trainers, args.providers, args.jobs, args.datasets, args.procs) < 1 or args.progress < 0:
        parser().error("--trainers, --providers, --jobs, --datasets and --procs must be at least 1")
    if not 0 <= args.jitter < 1:
        parser().error(f"--jitter is a fraction of --step-ms in [0, 1), got {args.jitter}")
    args.datasets = min(args.datasets, args.providers)  # every dataset has a provider
    result = run(args)
    print_result(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
