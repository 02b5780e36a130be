"""What every row of the remote benchmark reads through: the store process (a range server and, for the MDS
rows, an S3 server, answering each request after a delay that can be set while they run: :class:`Store`) and
a router and one provider serving its datasets (``busctl start`` processes: :class:`Cluster`), with the
wait that lets a failed row's reads end before the next row starts (:func:`settle`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, cast

__all__ = [
    "FAIL_FAST",
    "REPO",
    "ROW_GRACE_S",
    "SEED",
    "Cluster",
    "FullCollections",
    "Store",
    "end_child",
    "probe_once",
    "settle",
]

REPO = Path(__file__).resolve().parents[2]
SEED = 7
#: A row whose loader gets no batch for this long has failed (its loader's own timeouts come first).
ROW_GRACE_S = 60.0
#: The measured loaders give up at their first request unanswered within the default 10 s (no resend,
#: no wait for the provider to come back): that bounds a row, and a loader that would drop its provider
#: is a row's ``error``, not minutes of retries.
FAIL_FAST = {"retries": 0, "provider_wait_s": 0.0}
#: How often the head-of-line probe opens a new client, and how long it waits for each answer.
PROBE_EVERY_S, PROBE_TIMEOUT_S = 0.25, 10.0

#: The store process: a range server over ``argv[1]`` and, when ``argv[2]`` names an MDS folder, an
#: S3 server holding it at ``s3://bench/mds/``; with ``argv[3]``, the address the range server listens
#: at (instead of 127.0.0.1); prints their addresses as one JSON line, then answers
#: each line of stdin (``delay MS``: set both servers' delay; ``count``) with the GETs both have
#: answered so far, until EOF.
STORE = """
import json, sys
from pathlib import Path
from tests.support.httpd import RangeServer
# in a namespace of its own (argv[3]): served at that address itself, no Python relay in the bytes' way
http = RangeServer(Path(sys.argv[1]), host=sys.argv[3] if len(sys.argv) > 3 else "127.0.0.1")
s3 = None
out = {"http": http.url}
if sys.argv[2]:
    from tests.support.s3server import S3Server
    s3 = S3Server()
    s3.put_dir("bench", "mds", Path(sys.argv[2]))
    out["s3"] = s3.env()
print(json.dumps(out), flush=True)
try:
    for line in sys.stdin:  # "delay MS" or "count"
        word, _, value = line.partition(" ")
        if word == "delay":
            http.delay_s = float(value) / 1000
            if s3 is not None:
                s3.delay_s = http.delay_s
        gets = sum(m == "GET" for m, _, _ in list(http.requests))
        if s3 is not None:
            gets += sum(m == "GET" for m, _, _ in list(s3.requests))
        print(json.dumps({"gets": gets}), flush=True)
finally:
    http.close()
    if s3 is not None:
        s3.close()
"""


def end_child(proc: subprocess.Popen, timeout_s: float) -> None:
    """End a child that runs until its stdin closes: close it, wait ``timeout_s``, then kill."""
    with contextlib.suppress(OSError):
        cast(IO[str], proc.stdin).close()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Store:
    """The store process (:data:`STORE`); :meth:`delay` sets its latency. Ends with its stdin."""

    def __init__(self, root: Path, mds: Path | None, prefix: tuple[str, ...] = (), address: str = ""):
        """``prefix``: a command the store runs under (``ip netns exec NS``); ``address``: where it is reached."""
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-c", STORE, str(root), str(mds or ""), *([address] if address else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        line = self._line(120)
        if not line:
            self.close()
            raise RuntimeError("the store process exited before serving (its error is above)")
        self.urls = json.loads(line)
        self.latency_ms = 0.0

    def _line(self, timeout_s: float) -> str:
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.append(cast(IO[str], self.proc.stdout).readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        return out[0].strip() if out else ""

    def _ask(self, line: str) -> dict:
        cast(IO[str], self.proc.stdin).write(line + "\n")
        cast(IO[str], self.proc.stdin).flush()
        answer = self._line(30)
        if not answer:
            raise RuntimeError(f"the store did not answer {line!r}")
        return json.loads(answer)

    def delay(self, ms: float) -> None:
        """Every request answered ``ms`` late from now on."""
        self._ask(f"delay {ms}")
        self.latency_ms = ms

    def gets(self) -> int:
        """GET requests both servers have answered so far."""
        return int(self._ask("count")["gets"])

    def close(self) -> None:
        end_child(self.proc, 20)


class FullCollections:
    """The provider's full (generation 2) garbage collections so far, from its ``/metrics``: no Python code
    of it runs during one. ``since(earlier)``: those between two readings."""

    def __init__(self, buckets: list[tuple[float, float]], seconds: float):
        self.buckets = buckets  # (upper bound in seconds, cumulative count), +Inf last
        self.seconds = seconds

    def since(self, earlier: FullCollections) -> dict[str, float]:
        """``collections``, ``ms`` (in all) and ``each_at_most_ms`` (the histogram's bound; 0: none)."""
        before = dict(earlier.buckets)
        counts = [(bound, n - before.get(bound, 0)) for bound, n in self.buckets]
        total = counts[-1][1] if counts else 0
        at_most = next((bound for bound, n in counts if n == total), 0.0) if total else 0.0
        return {"collections": total, "ms": (self.seconds - earlier.seconds) * 1e3, "each_at_most_ms": at_most * 1e3}


class Cluster:
    """A router and one provider (``busctl start`` processes, under ``prefix``: ``ip netns exec NS``)
    serving ``datasets`` (name → URI), the provider with ``env`` in its environment and ``provider_args`` on
    its command line; a trainer token scoped to those datasets. The provider's metrics are on
    :attr:`metrics_url` (in ``prefix``'s namespace)."""

    def __init__(
        self,
        state: Path,
        datasets: dict[str, str],
        env: dict[str, str],
        prefix: tuple[str, ...] = (),
        provider_args: tuple[str, ...] = (),
    ):
        from libbus.security.auth import ensure_secret, issue_token  # noqa: PLC0415

        state.mkdir(parents=True, exist_ok=True)
        self.state, self.prefix = state, prefix
        secret = ensure_secret(state / "secret")
        self.token = issue_token(
            secret, sub="bench", role="trainer", audience="batchbus", ttl_s=3600, datasets=list(datasets)
        )
        self.procs: list[subprocess.Popen] = []
        try:
            router = self._start("router", ["--bind", "tcp://127.0.0.1:0"], {})
            flags = [a for name, uri in datasets.items() for a in ("--dataset", f"{name}={uri}")]
            flags += ["--metrics-bind", "127.0.0.1:0"]  # port 0: its URL is in its log (INFO) before it is ready
            self.endpoint = self._start("provider", ["--router", router, *provider_args, *flags], env, "INFO")
            said = re.findall(r"metrics on (http://\S+/metrics)", (state / "provider.log").read_text(errors="replace"))
            if not said:
                raise RuntimeError("the provider's log does not say where its metrics are")
            self.metrics_url = said[-1]  # the log is appended to: this provider's line is the last
        except BaseException:
            self.stop()
            raise

    def _start(self, role: str, args: list[str], env: dict[str, str], log_level: str = "WARNING") -> str:
        from services.launch import READY_TIMEOUT_S  # noqa: PLC0415

        ready = self.state / f"{role}.endpoint"
        cmd = [*self.prefix, sys.executable, "-m", "cli", "start", role, "--state-dir", str(self.state)]
        cmd += ["--log-level", log_level, "--ready-file", str(ready), *args]
        with open(self.state / f"{role}.log", "ab") as log:
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                    env={**os.environ, "PYTHONPATH": str(REPO), **env},
                )
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.exists():
            if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                log_tail = (self.state / f"{role}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the {role} did not start; its log ends:\n{log_tail}")
            time.sleep(0.05)
        return ready.read_text().strip()

    def loader(self, dataset: str, shuffle: str, batch: int, **kw: Any):
        from libbus.loader.remote import RemoteLoader  # noqa: PLC0415

        return RemoteLoader(
            dataset,
            provider=self.endpoint,
            token=self.token,
            batch_size=batch,
            shuffle=shuffle,
            seed=SEED,
            drop_last=True,
            **{**FAIL_FAST, **kw},
        )

    def metric(self, name: str) -> list:
        """The samples of the provider's metric family ``name`` now (from its ``/metrics``); [] if none."""
        import urllib.request  # noqa: PLC0415

        from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

        with urllib.request.urlopen(self.metrics_url, timeout=10) as resp:
            text = resp.read().decode()
        return next((fam.samples for fam in text_string_to_metric_families(text) if fam.name == name), [])

    def full_collections(self) -> FullCollections:
        """The provider's full garbage collections so far (its ``batchbus_gc_pause_seconds``)."""
        buckets, seconds = [], 0.0
        for sample in self.metric("batchbus_gc_pause_seconds"):
            if sample.labels.get("generation") != "2":
                continue
            if sample.name.endswith("_bucket"):
                buckets.append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_sum"):
                seconds = sample.value
        return FullCollections(sorted(buckets), seconds)

    def stop(self) -> None:
        """SIGTERM each service (provider first), then wait; one that will not end is killed."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def probe_once(cluster: Cluster) -> tuple[float, float]:
    """A new client's ``Hello`` and then ``DatasetInfo`` of the local dataset: seconds each (a timeout
    counts as :data:`PROBE_TIMEOUT_S`)."""
    from libbus.connect.client import Client, Identity  # noqa: PLC0415
    from libbus.errors import PeerTimeout  # noqa: PLC0415
    from libbus.wire.messages import DatasetInfoRequest  # noqa: PLC0415

    client = Client(cluster.endpoint, Identity(role="trainer", name=f"probe-{os.getpid()}", token=cluster.token))
    try:
        t = time.perf_counter()
        try:
            client.hello(PROBE_TIMEOUT_S)
        except PeerTimeout:
            return PROBE_TIMEOUT_S, PROBE_TIMEOUT_S
        hello = time.perf_counter() - t
        t = time.perf_counter()
        try:
            client.request(DatasetInfoRequest(dataset="file"), timeout_s=PROBE_TIMEOUT_S, retries=0)
        except PeerTimeout:
            return hello, PROBE_TIMEOUT_S
        return hello, time.perf_counter() - t
    finally:
        client.close()


def settle(cluster: Cluster, store: Store) -> float:
    """Wait (at most :data:`ROW_GRACE_S`) until the provider answers a new client at once and the store
    has had no request for a second: a failed row's reads are over. Returns the seconds waited."""
    start = time.monotonic()
    gets = store.gets()
    while time.monotonic() - start < ROW_GRACE_S:
        time.sleep(1.0)
        now = store.gets()
        if now == gets and sum(probe_once(cluster)) < 0.5:
            break
        gets = now
    return time.monotonic() - start
