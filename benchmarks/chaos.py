"""A chaos soak: jobs keep running while a seeded schedule kills, stops and restarts every service.

A router, two provider replicas of one dataset and four trainers (two reading through shared
memory, two over the socket) run as ``busctl start`` processes on one state directory. Waves of jobs
(single trainers and a ``world_size = 2`` gang) are submitted for ``--minutes``, while every few
seconds a random service gets ``kill -9`` (restarted), ``SIGTERM`` (restarted) or ``SIGSTOP`` then
``SIGCONT``. At the end, with every service stopped cleanly, it checks and prints:

- every job ``succeeded``, or ``failed`` for a declared reason (poisoned after ``max_attempts``);
- every epoch of every succeeded job trained on each sample exactly once (the trainers' audit);
- no shared-memory ring or same-host socket file of any process it started is left behind;
- the router's sessions back to none and its memory against its baseline.

Exit status 1 if any check fails. ``python -m benchmarks.chaos --minutes 10 --seed 1``.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from libbus.connect.client import Client, Identity
from libbus.jobs.spec import TERMINAL_STATES
from libbus.jobs.state import JobState
from libbus.loader.remote import RemoteLoader
from libbus.security.auth import ensure_secret, issue_token
from libbus.wire.messages import GetJob, Resolve, SubmitJob
from services.trainer.attempt.audit import digest, effective_epochs
from shm.names import SHM_DIR, parse_name

REPO = Path(__file__).resolve().parents[1]
#: busctl from this checkout (its directory first on sys.path), whatever the environment installed
BUSCTL = [sys.executable, "-c", "from cli.app import main; main()"]
DATA = "mnist=mock://mnist?n=400"
SPEC = {
    "dataset": "mnist",
    "model": "mlp",
    "model_kwargs": {"hidden": 32},
    "epochs": 2,
    "batch_size": 20,
    "shuffle": "full",
    "seed": 3,
    "optimizer": "adam",
    "lr": 0.003,
    "evaluate": True,
    "checkpoint_every": 5,
    "max_attempts": 10,
}
#: Jobs per wave: three single-trainer jobs and one gang.
WAVE = [{}, {"epochs": 3}, {"checkpoint_every": 0}, {"world_size": 2}]
FAULTS = ("kill", "term", "stop")
#: A service sent SIGTERM that has not exited after this long is killed (and it is counted):
#: systemd's stop timeout is 90 s.
STOP_PATIENCE_S = 60.0


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class Soak:
    def __init__(self, state: Path, seed: int):
        self.state = state
        self.rng = random.Random(seed)
        ensure_secret(state / "secret")
        self.env = {
            **os.environ,
            "BATCHBUS_STATE_DIR": str(state),
            "BATCHBUS_HEARTBEAT_MS": "250",
            "BATCHBUS_HEARTBEAT_LIVENESS": "10",
            "BATCHBUS_LEASE_S": "4",
            "BATCHBUS_TORCH_THREADS": "1",
            "BATCHBUS_PROGRESS_INTERVAL_S": "0.5",
            "BATCHBUS_AUDIT_DIR": str(state / "audit"),
            "BATCHBUS_REQUEST_TIMEOUT_S": "3",
            "BATCHBUS_REQUEST_RETRIES": "1",
            "BATCHBUS_PROVIDER_WAIT_S": "5",
        }
        self.token = issue_token(
            (state / "secret").read_bytes().strip(), sub="chaos", role="admin", audience="batchbus", ttl_s=24 * 3600
        )
        self.procs: dict[str, subprocess.Popen] = {}
        self.args: dict[str, list[str]] = {}
        self.envs: dict[str, dict] = {}
        self.pids: set[int] = set()
        self.stopped: dict[str, float] = {}  # name -> when to SIGCONT
        self.down: dict[str, float] = {}  # name -> when to restart
        self.faults: Counter = Counter()
        #: Services that did not stop within STOP_PATIENCE_S of a SIGTERM.
        self.slow_stops: list[str] = []
        self.admin: Client | None = None
        self.endpoint = ""

    # -- processes ----------------------------------------------------------------------------------
    def start(self, name: str, *args: str, env: dict | None = None) -> None:
        self.args[name], self.envs[name] = list(args), env or {}
        with open(self.state / f"{name}.log", "a") as log:
            proc = subprocess.Popen(
                [*BUSCTL, "start", *args, "--name", name],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**self.env, **self.envs[name]},
            )
        self.procs[name] = proc
        self.pids.add(proc.pid)

    def restart(self, name: str) -> None:
        self.start(name, *self.args[name], env=self.envs[name])

    def boot(self) -> None:
        ready = self.state / "router.ep"
        self.start("router", "router", "--bind", "tcp://127.0.0.1:0", "--ready-file", str(ready))
        deadline = time.monotonic() + 60
        while not ready.exists():
            if time.monotonic() > deadline or self.procs["router"].poll() is not None:
                raise SystemExit(f"router did not start; see {self.state}/router.log")
            time.sleep(0.05)
        self.endpoint = ready.read_text().strip()
        self.env["BATCHBUS_ROUTER"] = self.endpoint
        # the router comes back on the same address after a fault
        self.args["router"] = ["router", "--bind", self.endpoint]
        self.admin = Client(
            self.endpoint, Identity(role="admin", name="chaos", token=self.token), timeout_s=2, retries=0
        )
        for name in ("p1", "p2"):
            self.start(name, "provider", "--bind", "tcp://127.0.0.1:0", "--dataset", DATA)
        for i in range(4):
            self.start(f"t{i + 1}", "trainer", env={} if i < 2 else {"BATCHBUS_SHM": "false"})

    def request(self, msg):
        while True:  # the router may be down or stopped right now: tend the schedule meanwhile
            try:
                return self.admin.request(msg)
            except Exception:  # noqa: BLE001 - waited out; the soak itself must not die of a fault
                self.tend(time.monotonic())
                time.sleep(0.2)

    def tend(self, now: float) -> None:
        """Continue stopped processes and restart downed ones whose time has come."""
        for name, at in list(self.stopped.items()):
            if now >= at:
                self.procs[name].send_signal(signal.SIGCONT)
                del self.stopped[name]
        for name, at in list(self.down.items()):
            proc = self.procs[name]
            if proc.poll() is None:
                if now >= at + STOP_PATIENCE_S:
                    proc.kill()
                    self.slow_stops.append(name)
                continue
            if now >= at:
                self.restart(name)
                del self.down[name]

    def inject(self, now: float) -> None:
        self.tend(now)
        candidates = [n for n in self.procs if n not in self.stopped and n not in self.down]
        name, fault = self.rng.choice(candidates), self.rng.choice(FAULTS)
        proc = self.procs[name]
        role = "router" if name == "router" else "provider" if name.startswith("p") else "trainer"
        self.faults[f"{fault} {role}"] += 1
        if fault == "stop":
            proc.send_signal(signal.SIGSTOP)
            self.stopped[name] = now + self.rng.uniform(0.5, 3.0)
        else:
            proc.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGTERM)
            self.down[name] = now + self.rng.uniform(0.3, 2.0)

    def settle(self) -> None:
        """Every stopped process continues, every downed one is restarted."""
        for name in list(self.stopped):
            self.procs[name].send_signal(signal.SIGCONT)
        self.stopped.clear()
        while self.down:
            self.tend(time.monotonic())
            time.sleep(0.2)

    def shutdown(self) -> None:
        order = sorted(self.procs, key=lambda n: n == "router")  # the router last
        for name in order:
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGCONT)
                self.procs[name].send_signal(signal.SIGTERM)
            try:
                self.procs[name].wait(30)
            except subprocess.TimeoutExpired:
                self.procs[name].kill()

    # -- jobs ---------------------------------------------------------------------------------------
    def submit_wave(self) -> list[str]:
        return [self.request(SubmitJob(spec={**SPEC, **extra})).job for extra in WAVE]

    def states(self, jobs: list[str]) -> dict[str, dict]:
        return {job: self.request(GetJob(job=job)).job for job in jobs}

    def train_digests(self) -> Counter:
        providers = self.request(Resolve(dataset="mnist")).providers
        with RemoteLoader(
            "mnist", provider=providers[0]["endpoint"], token=self.token, batch_size=10_000, shuffle="none", copy=True
        ) as loader:
            x, y = next(iter(loader))
        xs, ys = x.numpy(), y.numpy()
        return Counter(digest(xs[i].tobytes(), ys[i].tobytes()) for i in range(len(xs)))

    def sessions(self) -> int:
        out = subprocess.run(
            [*BUSCTL, "top", "--once", "--json", "--interval", "0.2"],
            cwd=REPO,
            env={**self.env, "BATCHBUS_TOKEN": self.token},
            capture_output=True,
            text=True,
            timeout=60,
        )
        try:
            import orjson

            view = orjson.loads(out.stdout)
            return len(view.get("trainers", [])) + len(view.get("providers", []))
        except ValueError:
            return -1


def leftovers(pids: set[int]) -> list[str]:
    """Rings and same-host sockets of any process this soak started, still on disk."""
    out = [p.name for p in SHM_DIR.glob("batchbus-*") if parse_name(p.name) in pids]
    for sock in SHM_DIR.glob(f"batchbus-ipc-{os.geteuid()}/*.sock"):
        pid = sock.name.split("-")[1]
        if pid.isdigit() and int(pid) in pids:
            out.append(sock.name)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--fault-every", type=float, default=6.0, help="mean seconds between faults")
    p.add_argument("--state", default="", help="state directory (default: a fresh temporary one)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the services log to their files; here only the figures
    state = Path(args.state or tempfile.mkdtemp(prefix="batchbus-chaos-"))
    soak = Soak(state, args.seed)
    jobs: list[str] = []
    ok = True
    try:
        soak.boot()
        time.sleep(3)
        baseline_rss = rss_kib(soak.procs["router"].pid)
        started = time.monotonic()
        end = started + 60 * args.minutes
        wave = soak.submit_wave()
        jobs += wave
        next_fault = started + soak.rng.expovariate(1 / args.fault_every)
        while time.monotonic() < end:
            now = time.monotonic()
            soak.tend(now)
            if now >= next_fault:
                soak.inject(now)
                next_fault = now + soak.rng.expovariate(1 / args.fault_every)
            # no new wave in the last fifth: the soak ends with its jobs, not with a fresh wave
            if now < end - 12 * args.minutes and all(j["state"] in TERMINAL_STATES for j in soak.states(wave).values()):
                wave = soak.submit_wave()
                jobs += wave
            time.sleep(0.5)
        soak.settle()
        settled = time.monotonic()
        deadline = settled + 300
        while True:
            final = soak.states(jobs)
            if all(j["state"] in TERMINAL_STATES for j in final.values()) or time.monotonic() > deadline:
                break
            time.sleep(1)
        drained_s = time.monotonic() - settled
        digests = soak.train_digests()
        end_rss = rss_kib(soak.procs["router"].pid)
        sessions_live = soak.sessions()
        by_state = Counter(j["state"] for j in final.values())
        epochs = samples = lost = 0
        undeclared = []
        for job, info in final.items():
            if info["state"] == JobState.SUCCEEDED:
                spec_epochs = info["spec"]["epochs"]
                seen = effective_epochs(state / "audit", job)
                if sorted(seen) != list(range(spec_epochs)) or len(info["result"].get("history", [])) != spec_epochs:
                    lost += 1
                    print(f"job {job}: epochs {sorted(seen)}, history {len(info['result'].get('history', []))}")
                for epoch, got in seen.items():
                    epochs += 1
                    samples += sum(got.values())
                    if got != digests:
                        lost += sum((digests - got).values()) + sum((got - digests).values())
                        print(f"job {job} epoch {epoch}: not exactly once")
            elif not (info["state"] == JobState.FAILED and "poisoned" in (info["error"] or "")):
                undeclared.append(f"{job} {info['state']}: {info['error']}")
    finally:
        soak.settle()
        soak.shutdown()
    time.sleep(1)
    left = leftovers(soak.pids)
    ok = (
        not undeclared
        and not lost
        and not left
        and not soak.slow_stops
        and all(j["state"] in TERMINAL_STATES for j in final.values())
    )
    print(f"chaos soak: {args.minutes:g} min, seed {args.seed}, state {state}")
    print(
        "faults injected: "
        + ", ".join(f"{k} {v}" for k, v in sorted(soak.faults.items()))
        + f" (total {sum(soak.faults.values())})"
    )
    print(
        f"jobs: {len(final)} ({', '.join(f'{k} {v}' for k, v in sorted(by_state.items()))}); "
        f"undeclared endings: {len(undeclared)}"
    )
    for line in undeclared:
        print("  " + line)
    print(f"after the last fault, the jobs in flight ended within {drained_s:.0f} s")
    print(f"epochs audited: {epochs}, samples audited: {samples}, data lost or repeated: {lost}")
    print(f"left behind (rings, sockets): {len(left)} {left if left else ''}")
    print(
        f"services that took over {STOP_PATIENCE_S:.0f} s to stop on SIGTERM: {len(soak.slow_stops)} "
        f"{soak.slow_stops if soak.slow_stops else ''}"
    )
    print(
        f"router: sessions before shutdown {sessions_live} (4 trainers + 2 providers expected), "
        f"RSS baseline {baseline_rss / 1024:.1f} MiB, at end {end_rss / 1024:.1f} MiB"
    )
    print("result: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
