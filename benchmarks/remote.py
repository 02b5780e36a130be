"""Data behind a network: a provider reading a store with a fixed delay per request, and its local
datasets beside it.

One invocation, one generated CIFAR-shaped dataset (:func:`benchmarks.delivery.make_dataset`:
float32 3×32×32 + int64 label, 12,296 B a sample), one router and one provider (real processes)
serving it three ways, and a store process holding the test suite's range server
(``tests/support/httpd.py``, so run it from a checkout) and, for the MDS rows, its S3 server (moto
behind a proxy, ``tests/support/s3server.py``). The store answers every request after
``--latency-ms`` (each value in turn, set while the provider runs), as an object store's first byte
comes late. Every row is a ``RemoteLoader(batch_size=256)`` (``--batch``) read for ``--seconds``,
each batch's samples checked against the dataset by content:

=================  ==================================================================================
file               ``file://`` on the provider's disk: the local baseline (``block`` and ``full`` shuffle)
http               the ``.npy`` pair as ``http://`` from the range server, per latency and shuffle
s3-mds             the samples as MDS shards (Streaming's ``MDSWriter``, ``--mds-shard-mb``) at ``s3://``
mosaic             MosaicML Streaming's ``StreamingDataset`` (``shuffle=True``) + DataLoader
                   (``--workers``) reading the same MDS from the same store (a fresh local cache each
                   row: a cold read), in a process of its own
head-of-line       the ``file`` dataset's wait per batch, a loop of ``--step-ms`` per step, alone and
                   while another loader reads ``http`` (full shuffle, ``--hol-latency-ms``) from the
                   same provider; meanwhile a new client's ``Hello`` and ``DatasetInfo`` timed
                   every 0.25 s (the worst is what a new trainer would wait); ``--hol-busy N``: both
                   phases beside N busy loops (a deliberate load, each ending by itself)
htb (``--htb``)    the store in a network namespace of its own behind a veth capped at ``--htb-mbit``
                   by ``htb`` (root only), the provider and loader in another: block shuffle's MB/s as a
                   fraction of the cap, at ``--htb-latency-ms`` (its loader's first batches left out, and
                   the link's own byte counter over the same window); ``--htb-ram-cache``: read ahead
=================  ==================================================================================

``samples/s`` counts from a row's first batch to its last (start-up apart: ``first_s`` is the
time to the first batch); ``MB/s`` is samples/s × 12,296 B; ``× file`` is the ratio to the
``file`` row of the same shuffle, ``× mosaic`` an ``s3-mds`` row's ratio to ``mosaic`` at the same
latency. A row's loader gives up at its first request unanswered within 10 s (:data:`FAIL_FAST`):
the row then says why in place of its figures, and the next row waits until the provider and the store
are idle again. ::

    python -m benchmarks.remote --latency-ms 0,10,30,100 --seconds 5 --json remote.json
    python -m benchmarks.remote --quick
    python -m benchmarks.remote --quick --hol-only   # the head-of-line part alone
    python -m benchmarks.remote --hol-only --seconds 5 --hol-busy 2   # ... beside two spinning cores
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import IO, Any, cast

import numpy as np

from benchmarks.netns import VethHosts
from benchmarks.netns import run as sh
from libbus.errors import BusError

__all__ = ["main", "run"]

REPO = Path(__file__).resolve().parents[1]
SEED = 7
SAMPLE_BYTES = 3 * 32 * 32 * 4 + 8
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


# -- checking what arrives ----------------------------------------------------------------------------


class Fingerprints:
    """Which sample a row of a batch is, from its first 8 bytes; a batch checks when every row is a
    sample of the dataset, with its own label and (for one row per batch) all its bytes."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        self.x, self.y = x, y
        keys = np.ascontiguousarray(x.reshape(len(x), -1)[:, :2]).view(np.int64).ravel()
        self.order = np.argsort(keys, kind="stable")
        self.keys = keys[self.order]

    def check(self, bx: np.ndarray, by: np.ndarray, where: str) -> None:
        keys = np.ascontiguousarray(bx.reshape(len(bx), -1)[:, :2]).view(np.int64).ravel()
        pos = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        idx = self.order[pos]
        if not np.array_equal(self.keys[pos], keys) or not np.array_equal(self.y[idx], by):
            raise RuntimeError(f"{where}: a batch holds samples (or labels) that are not the dataset's")
        if not np.array_equal(self.x[idx[-1]], bx[-1]):
            raise RuntimeError(f"{where}: sample {idx[-1]} arrived with other bytes than the dataset's")


def _arrays(batch: Any) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(batch, dict):  # Streaming's samples, collated: {"x": tensor, "y": tensor}
        return batch["x"].numpy(), batch["y"].numpy()
    x, y = batch
    return x.numpy(), y.numpy()


def drain(
    make: Iterable, seconds: float, where: str, check: Fingerprints | None, step_s: float = 0.0, warmup: int = 0
) -> dict[str, Any]:
    """Read passes of ``make`` (a loader) back to back for ``seconds``, timing every wait; with
    ``step_s``, sleep that long after each batch (a training step that leaves the cores free).

    The rate counts from the first batch to the last; with ``warmup`` (the loader's batches in flight), from
    batch ``warmup + 1`` on: the batches asked for together at the start arrive nearly together, their bytes
    mostly moved before the first one arrived, and counting them against the time after it counts bytes
    twice over (a link's rate came out above its cap). The row then also says the window's ends in
    ``time.monotonic()`` (``window``), for a link counter read by another process."""
    waits: list[float] = []
    stamps: list[float] = []
    samples: list[int] = []
    start = time.perf_counter()
    deadline = start + seconds
    it: Iterator | None = None
    while time.perf_counter() < deadline:
        if it is None:
            it = iter(make)
        t = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            it = None
            continue
        now = time.perf_counter()
        waits.append(now - t)
        stamps.append(now)
        bx, by = _arrays(batch)
        samples.append(len(bx))
        if check is not None:
            check.check(bx, by, where)
        del batch, bx, by
        if step_s:
            time.sleep(step_s)
    del it
    if not stamps:
        raise RuntimeError(f"{where}: no batch within {seconds:g} s")
    row: dict[str, Any] = {"batches": len(stamps), "first_s": stamps[0] - start}
    if warmup and len(stamps) >= warmup + 3:  # steady state: as many batches in flight at both ends
        rate = sum(samples[warmup + 1 :]) / (stamps[-1] - stamps[warmup])
        to_mono = time.monotonic() - time.perf_counter()
        row.update(window=(stamps[warmup] + to_mono, stamps[-1] + to_mono), warmup_batches=warmup)
    elif len(stamps) >= 3:  # from the first batch to the last: start-up (connections, pipeline fill) apart
        if warmup:
            row["note"] = f"fewer than {warmup + 3} batches: the first batches' bytes are counted in the rate"
        rate = sum(samples[1:]) / (stamps[-1] - stamps[0])
    else:  # too few batches for that: the whole window, start-up included
        rate = sum(samples) / (stamps[-1] - start)
        row["note"] = "start-up included (under 3 batches)"
    ms = np.array(waits[1:] or waits) * 1e3
    row.update(
        samples_per_s=rate,
        mb_per_s=rate * SAMPLE_BYTES / 1e6,
        p50_ms=float(np.percentile(ms, 50)),
        p99_ms=float(np.percentile(ms, 99)),
        max_ms=float(ms.max()),
    )
    return row


# -- the store and the services -------------------------------------------------------------------------


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
        with contextlib.suppress(OSError):
            cast(IO[str], self.proc.stdin).close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Cluster:
    """A router and one provider (``busctl start`` processes, under ``prefix``: ``ip netns exec NS``)
    serving ``datasets`` (name → URI), the provider with ``env`` in its environment; a trainer token
    scoped to those datasets."""

    def __init__(self, state: Path, datasets: dict[str, str], env: dict[str, str], prefix: tuple[str, ...] = ()):
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
            self.endpoint = self._start("provider", ["--router", router, *flags], env)
        except BaseException:
            self.stop()
            raise

    def _start(self, role: str, args: list[str], env: dict[str, str]) -> str:
        from services.launch import READY_TIMEOUT_S  # noqa: PLC0415

        ready = self.state / f"{role}.endpoint"
        cmd = [*self.prefix, sys.executable, "-m", "cli", "start", role, "--state-dir", str(self.state)]
        cmd += ["--log-level", "WARNING", "--ready-file", str(ready), *args]
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


def loader_row(cluster: Cluster, dataset: str, shuffle: str, args: argparse.Namespace, fp: Fingerprints, **kw) -> dict:
    """One row: a fresh loader of ``dataset`` read for ``args.seconds``; a failure is the row's ``error``."""
    try:
        with cluster.loader(dataset, shuffle, args.batch, **kw) as loader:
            return drain(loader, args.seconds, f"{dataset} ({shuffle})", fp)
    except (BusError, RuntimeError) as err:  # the row says what went wrong; the benchmark goes on
        return {"error": f"{type(err).__name__}: {err}"[:300]}


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


# -- MosaicML Streaming ----------------------------------------------------------------------------------------


def write_mds(x: np.ndarray, y: np.ndarray, out: Path, shard_mb: int) -> Path:
    """The samples as MDS shards of ``shard_mb`` MB at most, written by Streaming's ``MDSWriter``."""
    from benchmarks.peer_rows import streaming_without_torchvision  # noqa: PLC0415

    streaming_without_torchvision()  # before Streaming's import (importing peer_rows did it: said here)
    from streaming import MDSWriter  # noqa: PLC0415

    columns = {"x": f"ndarray:float32:{','.join(map(str, x.shape[1:]))}", "y": "int64"}
    with MDSWriter(out=str(out), columns=columns, size_limit=f"{shard_mb}mb") as writer:
        for i in range(len(y)):
            writer.write({"x": x[i], "y": int(y[i])})
    return out


def mosaic_child(cfg_json: str) -> None:
    """In a process of its own (Streaming starts shared memory and worker processes): read the MDS at
    ``s3://bench/mds`` with ``StreamingDataset`` + DataLoader for ``seconds``; print one JSON line."""
    import torch  # noqa: PLC0415

    from benchmarks.peer_rows import MosaicSamples, streaming_without_torchvision  # noqa: PLC0415

    streaming_without_torchvision()  # before Streaming's import (importing peer_rows did it: said here)
    from streaming import StreamingDataset  # noqa: PLC0415

    cfg = json.loads(cfg_json)
    dataset = StreamingDataset(
        remote="s3://bench/mds", local=cfg["local"], shuffle=True, shuffle_seed=SEED, batch_size=cfg["batch"]
    )
    loader = torch.utils.data.DataLoader(
        MosaicSamples(dataset), batch_size=cfg["batch"], drop_last=True, num_workers=cfg["workers"]
    )
    x, y = np.load(Path(cfg["root"]) / "train_x.npy", mmap_mode="r"), np.load(Path(cfg["root"]) / "train_y.npy")
    row = drain(loader, cfg["seconds"], "mosaic", Fingerprints(np.asarray(x), y))
    print(json.dumps(row), flush=True)


def mosaic_row(store: Store, root: Path, work: Path, args: argparse.Namespace) -> dict:
    """The mosaic row in a child process (its own session: its DataLoader workers end with it)."""
    local = Path(tempfile.mkdtemp(prefix="mosaic-", dir=work))  # cold: nothing downloaded yet
    cfg = {
        "local": str(local),
        "batch": args.batch,
        "workers": args.workers,
        "seconds": args.seconds,
        "root": str(root),
    }
    s3 = store.urls["s3"]
    env = {**os.environ, **s3, "S3_ENDPOINT_URL": s3["AWS_ENDPOINT_URL"], "PYTHONPATH": str(REPO)}
    code = "import sys; from benchmarks.remote import mosaic_child; mosaic_child(sys.argv[1])"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=args.seconds + ROW_GRACE_S + 60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the child's session: it and its workers
        proc.communicate()
        return {"error": f"no result within {args.seconds + ROW_GRACE_S + 60:.0f} s"}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # workers left behind by a child that exited
        shutil.rmtree(local, ignore_errors=True)
    lines = out.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {err.strip().splitlines()[-1:] or ['(no output)']}"[:300]}
    return json.loads(lines[-1])


# -- head-of-line --------------------------------------------------------------------------------------------


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


def slow_child(config: str) -> None:
    """The head-of-line part's slow loader, in a process of its own: ``http`` with full shuffle until
    SIGTERM; prints ``reading`` at its first batch, then (at the end) ``{"batches": n}`` or ``{"error": ...}``
    as its last line."""
    cfg = json.loads(config)
    from libbus.loader.remote import RemoteLoader  # noqa: PLC0415

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    got: dict[str, Any] = {"batches": 0}
    try:
        with RemoteLoader(
            "http",
            provider=cfg["endpoint"],
            token=cfg["token"],
            batch_size=cfg["batch"],
            shuffle="full",
            seed=SEED,
            drop_last=True,
            **cast(dict[str, Any], FAIL_FAST),
        ) as loader:
            while not stop.is_set():
                for _ in loader:
                    got["batches"] += 1
                    if got["batches"] == 1:
                        print("reading", flush=True)
                    if stop.is_set():
                        break
    except (BusError, RuntimeError) as err:
        got["error"] = f"{type(err).__name__}: {err}"[:300]
        if not got["batches"]:
            print("failed", flush=True)
    print(json.dumps(got), flush=True)


#: The most busy loops ``--hol-busy`` starts (each spins a core: more only starves the machine).
MAX_BUSY_LOOPS = 64


def busy_loops(n: int, seconds: float) -> list[subprocess.Popen]:
    """``n`` processes spinning a core each, every one ending by itself after ``seconds`` at most (a
    deliberate load, bounded in time whatever happens to this process)."""
    code = "import sys, time\nt = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < t: pass"
    return [subprocess.Popen([sys.executable, "-c", code, str(seconds)]) for _ in range(n)]


def head_of_line(cluster: Cluster, store: Store, args: argparse.Namespace, fp: Fingerprints) -> dict:
    """The local dataset's waits alone and beside a loader reading the slow remote dataset; new
    clients' Hello and DatasetInfo times meanwhile (and alone, before). ``--hol-busy N``: both phases
    beside N busy loops."""
    loops = busy_loops(args.hol_busy, 4 * args.seconds + 60)
    try:
        return _head_of_line(cluster, store, args, fp) | {"busy_loops": args.hol_busy}
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def _head_of_line(cluster: Cluster, store: Store, args: argparse.Namespace, fp: Fingerprints) -> dict:
    step = args.step_ms / 1e3
    out: dict[str, Any] = {"latency_ms": args.hol_latency_ms, "step_ms": args.step_ms}
    quiet = [probe_once(cluster) for _ in range(5)]
    with cluster.loader("file", "full", args.batch) as loader:
        out["alone"] = drain(loader, args.seconds, "file alone", fp, step)
    store.delay(args.hol_latency_ms)
    stop = threading.Event()
    # the slow loader in a process of its own, as another trainer is: the measured loader's waits are
    # then the provider's, not this process's GIL shared with the other loader's decoding
    cfg = {"endpoint": cluster.endpoint, "token": cluster.token, "batch": args.batch}
    code = "import sys; from benchmarks.remote import slow_child; slow_child(sys.argv[1])"
    child = subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    probes: list[tuple[float, float]] = []

    def probe() -> None:
        while not stop.is_set():
            probes.append(probe_once(cluster))
            stop.wait(PROBE_EVERY_S)

    probe_thread = threading.Thread(target=probe, daemon=True)
    slow: dict[str, Any] = {"batches": 0}
    try:
        assert child.stdout is not None
        first = child.stdout.readline()  # its first batch: the provider is busy with it (or it failed)
        if first.strip() == "reading":
            probe_thread.start()
            with cluster.loader("file", "full", args.batch) as loader:
                out["beside"] = drain(loader, args.seconds, "file beside http", fp, step)
    finally:
        stop.set()
        if probe_thread.ident is not None:
            probe_thread.join(PROBE_TIMEOUT_S * 2 + 5)
        child.send_signal(signal.SIGTERM)
        try:
            rest, err = child.communicate(timeout=ROW_GRACE_S)
        except subprocess.TimeoutExpired:
            child.kill()
            rest, err = child.communicate()
    lines = rest.strip().splitlines()
    try:
        slow = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        slow["error"] = f"exit {child.returncode}: {err.strip().splitlines()[-1:] or ['(no output)']}"[:300]
    if "beside" not in out:  # the slow loader failed before its first batch: nothing to measure beside
        out["slow_loader"], out["error"] = slow, f"the http loader read no batch: {slow.get('error', '?')}"
        return out
    out["slow_loader"] = slow
    out["p99_ratio"] = out["beside"]["p99_ms"] / max(out["alone"]["p99_ms"], 1e-3)
    for name, got in (("quiet", quiet), ("busy", probes)):
        if got:
            out[f"hello_{name}_max_ms"] = max(h for h, _ in got) * 1e3
            out[f"info_{name}_max_ms"] = max(i for _, i in got) * 1e3
    out["probes"] = len(probes)
    return out


# -- the run --------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    from benchmarks.delivery import make_dataset  # noqa: PLC0415 - torch loads after argument checks

    work = Path(tempfile.mkdtemp(prefix="batchbus-remote-"))
    store: Store | None = None
    cluster: Cluster | None = None
    try:
        root = work / "data"
        root.mkdir()
        make_dataset(root, args.samples)
        x, y = np.load(root / "train_x.npy"), np.load(root / "train_y.npy")
        fp = Fingerprints(x, y)
        mds = None
        if args.mosaic:
            mds = write_mds(x, y, work / "mds", args.mds_shard_mb)
        store = Store(work, mds)
        datasets = {
            "file": f"file://{root}?memory=stream&val_fraction=0",
            "http": f"{store.urls['http']}/data/?val_fraction=0",
        }
        # full shuffle with a RAM cache that holds the window (for a full shuffle, the files): one dataset
        # per latency, so that each row starts cold; its loader reads ahead (RemoteLoader's read_ahead)
        cache = int((root / "train_x.npy").stat().st_size * 1.2) + (8 << 20)
        for ms in [] if args.hol_only else args.latencies:
            datasets[f"hc{ms:g}"] = f"{store.urls['http']}/data/?val_fraction=0&ram_cache={cache}"
        if mds is not None:
            datasets["mds"] = "s3://bench/mds/?fields=x&label=y&val_fraction=0"
            for ms in args.latencies:
                datasets[f"mc{ms:g}"] = f"{datasets['mds']}&cache=off&ram_cache={cache}"
        cluster = Cluster(work / "state", datasets, store.urls.get("s3", {}))
        rows: list[dict] = []

        def add(measure: Callable[[], dict], **what: Any) -> None:
            gets = store.gets()
            row = {**what, **measure()}
            if "batches" in row:  # the batches read past the window (prefetched) count too: a few
                row["gets_per_batch"] = (store.gets() - gets) / row["batches"]
            else:  # failed: what it left the provider reading ends before the next row starts
                row["settled_s"] = settle(cluster, store)
            rows.append(row)
            shown = row.get("error") or f"{row['samples_per_s']:,.0f} samples/s, {row['mb_per_s']:.1f} MB/s"
            print(f"  {row['path']:12s} {row['shuffle']:5s} {row.get('latency_ms', '-')!s:>5} ms: {shown}", flush=True)

        for shuffle in args.shuffles:  # none with --hol-only
            add(partial(loader_row, cluster, "file", shuffle, args, fp), path="file", shuffle=shuffle)
        for ms in [] if args.hol_only else args.latencies:
            store.delay(ms)
            for shuffle in args.shuffles:
                add(
                    partial(loader_row, cluster, "http", shuffle, args, fp), path="http", shuffle=shuffle, latency_ms=ms
                )
            if "full" in args.shuffles:
                cached = partial(loader_row, cluster, f"hc{ms:g}", "full", args, fp)
                add(cached, path="http+cache", shuffle="full", latency_ms=ms)
            if mds is not None:
                add(partial(mosaic_row, store, root, work, args), path="mosaic", shuffle="py1e", latency_ms=ms)
                for shuffle in args.shuffles:
                    add(
                        partial(loader_row, cluster, "mds", shuffle, args, fp),
                        path="s3-mds",
                        shuffle=shuffle,
                        latency_ms=ms,
                    )
                if "full" in args.shuffles:
                    cached = partial(loader_row, cluster, f"mc{ms:g}", "full", args, fp)
                    add(cached, path="s3-mds+cache", shuffle="full", latency_ms=ms)
        result: dict[str, Any] = {
            "samples": args.samples,
            "batch": args.batch,
            "sample_bytes": SAMPLE_BYTES,
            "seconds": args.seconds,
            "cores": os.cpu_count(),
            "load_before": os.getloadavg(),
            "rows": rows,
        }
        add_ratios(rows)
        if args.hol:
            settle(cluster, store)  # the last row's reads (prefetched, or abandoned) are over: a quiet start
            result["head_of_line"] = head_of_line(cluster, store, args, fp)
        if args.htb:
            result["htb"] = htb_row(root, work, args)
        result["load_after"] = os.getloadavg()
    finally:
        if cluster is not None:
            cluster.stop()
        if store is not None:
            store.close()
        shutil.rmtree(work, ignore_errors=True)
    return result


def add_ratios(rows: list[dict]) -> None:
    """``x_file``: samples/s over the file row of the same shuffle; ``x_mosaic``: an s3-mds row's over
    the mosaic row at its latency."""
    file = {r["shuffle"]: r for r in rows if r["path"] == "file" and "error" not in r}
    mosaic = {r["latency_ms"]: r for r in rows if r["path"] == "mosaic" and "error" not in r}
    for r in rows:
        if "error" in r:
            continue
        if r["shuffle"] in file:
            r["x_file"] = r["samples_per_s"] / file[r["shuffle"]]["samples_per_s"]
        if r["path"] in ("s3-mds", "s3-mds+cache") and r["latency_ms"] in mosaic:
            r["x_mosaic"] = r["samples_per_s"] / mosaic[r["latency_ms"]]["samples_per_s"]


# -- a capped link (htb) ---------------------------------------------------------------------------------------


#: The store's and the provider's ends of the capped veth.
STORE_ADDR, PROVIDER_ADDR = "10.215.0.1", "10.215.0.2"


class CappedLink(VethHosts):
    """Namespaces ``<tag>-s`` (the store) and ``<tag>-p`` (router, provider, loader) joined by a veth
    whose store end sends at most ``mbit`` (one ``htb`` class for all its traffic: the cap is the
    link's, not a flow's). Deleted by :meth:`close`, which the caller always calls."""

    def __init__(self, mbit: int):
        super().__init__(f"bbr{os.getpid() % 100000}", (("s", "vs", STORE_ADDR), ("p", "vp", PROVIDER_ADDR)))
        self.store, self.provider = self.a, self.b
        try:
            sh("tc", "-n", self.store, "qdisc", "add", "dev", "vs", "root", "handle", "1:", "htb", "default", "10")
            sh("tc", "-n", self.store, "class", "add", "dev", "vs", "parent", "1:", "classid", "1:10", "htb",
                "rate", f"{mbit}mbit", "ceil", f"{mbit}mbit", "quantum", "60000")  # fmt: skip
        except BaseException:
            self.close()
            raise

    def sent_bytes(self) -> int:
        """Bytes the capped class has sent so far (store → provider)."""
        out = subprocess.run(
            ["tc", "-n", self.store, "-s", "class", "show", "dev", "vs"], capture_output=True, text=True, timeout=30
        ).stdout
        found = re.search(r"class htb 1:10 .*\n Sent (\d+) bytes", out)
        return int(found.group(1)) if found else 0

    def count_sent(self) -> LinkCounter:
        """The store end's bytes sent, read every :data:`LINK_EVERY_S` until closed (:class:`LinkCounter`)."""
        return LinkCounter(self.exec(self.store))


#: How often :class:`LinkCounter` reads the link's byte counter.
LINK_EVERY_S = 0.05
#: Reads ``vs``'s bytes sent (frames: payload and TCP/IP/Ethernet headers) in the namespace it runs in, with
#: ``time.monotonic()`` (one clock for every process of the machine), every ``argv[1]`` seconds until stdin closes.
LINK_READER = """
import select, sys, time
while not select.select([sys.stdin], [], [], float(sys.argv[1]))[0]:
    with open("/sys/class/net/vs/statistics/tx_bytes") as f:
        print(time.monotonic(), f.read().strip(), flush=True)
"""


class LinkCounter:
    """The capped link's bytes sent over time, read in the store's namespace by one process (not a ``tc``
    per read: two cores), so that a rate can be taken over exactly the loader's window (:meth:`rate`)."""

    def __init__(self, prefix: tuple[str, ...]):
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-c", LINK_READER, str(LINK_EVERY_S)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.reads: list[tuple[float, int]] = []
        self._thread = threading.Thread(target=self._collect, daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        for line in cast(IO[str], self.proc.stdout):
            stamp, sent = line.split()
            self.reads.append((float(stamp), int(sent)))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            cast(IO[str], self.proc.stdin).close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._thread.join(10)

    def rate(self, start: float, end: float) -> float | None:
        """Bytes per second sent between ``start`` and ``end`` (``time.monotonic()``), the counter
        interpolated between reads; None when the reads do not cover the window."""
        reads = self.reads
        if len(reads) < 2 or reads[0][0] > start or reads[-1][0] < end or end <= start:
            return None
        stamps = np.array([t for t, _ in reads])
        sent = np.array([b for _, b in reads], dtype=np.float64)
        return float((np.interp(end, stamps, sent) - np.interp(start, stamps, sent)) / (end - start))


#: The capped-link loader's batches in flight by default (RemoteLoader's default); ``--htb-inflight`` sets it.
HTB_INFLIGHT = 4
#: The most batches in flight ``--htb-inflight`` takes (each holds a batch of 256 samples, 3 MB, in the loader).
MAX_HTB_INFLIGHT = 64


def htb_child(cfg_json: str) -> None:
    """In the provider's namespace: read ``http`` with block shuffle for ``seconds``; print one JSON line."""
    from libbus.loader.remote import RemoteLoader  # noqa: PLC0415

    cfg = json.loads(cfg_json)
    root = Path(cfg["root"])
    fp = Fingerprints(np.load(root / "train_x.npy"), np.load(root / "train_y.npy"))
    with RemoteLoader(
        "http",
        provider=cfg["endpoint"],
        token=cfg["token"],
        batch_size=cfg["batch"],
        shuffle="block",
        seed=SEED,
        drop_last=True,
        inflight=cfg["inflight"],
    ) as loader:
        # the first batches, asked for together, are skipped: their bytes mostly crossed before the first arrived
        row = drain(loader, cfg["seconds"], "http behind htb", fp, warmup=cfg["inflight"])
    print(json.dumps(row), flush=True)


def htb_row(root: Path, work: Path, args: argparse.Namespace) -> dict:
    """Block shuffle from the store behind a veth capped by ``htb`` (:class:`CappedLink`) at
    ``args.htb_latency_ms`` per request: payload MB/s as a fraction of the cap."""
    from benchmarks.flows import netns_unavailable  # noqa: PLC0415

    why = netns_unavailable()
    if why:
        return {"error": why}
    out: dict[str, Any] = {
        "mbit": args.htb_mbit,
        "latency_ms": args.htb_latency_ms,
        "ram_cache": args.htb_ram_cache,
        "inflight": args.htb_inflight,
    }
    link = CappedLink(args.htb_mbit)
    store = cluster = None
    try:
        store = Store(root.parent, None, link.exec(link.store), STORE_ADDR)
        store.delay(args.htb_latency_ms)
        query = f"&ram_cache={args.htb_ram_cache}&block={1 << 20}" if args.htb_ram_cache else ""
        datasets = {"http": f"{store.urls['http']}/{root.name}/?val_fraction=0{query}"}
        cluster = Cluster(work / "htb-state", datasets, {}, link.exec(link.provider))
        cfg = {"root": str(root), "endpoint": cluster.endpoint, "token": cluster.token}
        cfg.update(batch=args.batch, seconds=args.seconds, inflight=args.htb_inflight)
        code = "import sys; from benchmarks.remote import htb_child; htb_child(sys.argv[1])"
        counter = link.count_sent()
        try:
            done = subprocess.run(
                [*link.exec(link.provider), sys.executable, "-c", code, json.dumps(cfg)],
                capture_output=True,
                text=True,
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO)},
                timeout=args.seconds + ROW_GRACE_S + 60,
            )
        finally:
            counter.close()
        if done.returncode != 0:
            return {**out, "error": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"[:300]}
        out.update(json.loads(done.stdout.strip().splitlines()[-1]))
        # samples' bytes delivered over the loader's steady window (drain's warmup), against the cap, and
        # what crossed the link in that same window, headers and all (never below the payload)
        out["fraction_of_cap"] = out["mb_per_s"] / (args.htb_mbit / 8)
        link_rate = counter.rate(*out["window"]) if "window" in out else None
        if link_rate is not None:
            out["link_mb_per_s"] = link_rate / 1e6
            out["link_fraction_of_cap"] = link_rate / 1e6 / (args.htb_mbit / 8)
        return out
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        return {**out, "error": f"{type(err).__name__}: {err}"[:300]}
    finally:
        if cluster is not None:
            cluster.stop()
        if store is not None:
            store.close()
        link.close()


# -- the command -------------------------------------------------------------------------------------------------


def _numbers(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected milliseconds, none negative, got {text!r}")
    return values


def _shuffles(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in ("block", "full")]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"shuffles are block and full, got {text!r}")
    return values


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.remote", description=__doc__.split("\n\n")[0])
    p.add_argument("--latency-ms", dest="latencies", type=_numbers, help="per-request delays (default 0,10,30,100)")
    p.add_argument("--shuffles", type=_shuffles, default=["block", "full"], help="block, full or both (default)")
    p.add_argument("--samples", type=int, help="dataset size (default 16384: 192 MiB)")
    p.add_argument("--seconds", type=float, help="each row's window (default 5)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="the mosaic row's DataLoader workers (default 0: see docs/performance.md)",
    )
    p.add_argument("--hol-latency-ms", type=float, default=30.0, help="the slow dataset's delay, head-of-line part")
    p.add_argument("--step-ms", type=float, default=10.0, help="the local loader's step, head-of-line part")
    p.add_argument(
        "--hol-busy",
        type=int,
        default=0,
        help="busy loops (a process spinning a core each) beside both head-of-line phases: a deliberate load",
    )
    p.add_argument("--mds-shard-mb", type=int, default=16, help="MDS shard size (default 16 MB)")
    p.add_argument("--no-mosaic", dest="mosaic", action="store_false", help="no MDS rows (no S3 server)")
    p.add_argument("--no-hol", dest="hol", action="store_false", help="no head-of-line part")
    p.add_argument(
        "--hol-only",
        action="store_true",
        help="only the head-of-line part (no rows, no MDS, no S3 server): to iterate on it",
    )
    p.add_argument("--htb", action="store_true", help="also the capped-link row (root: namespaces, htb)")
    p.add_argument("--htb-mbit", type=int, default=1000)
    p.add_argument("--htb-latency-ms", type=float, default=30.0)
    p.add_argument(
        "--htb-ram-cache",
        type=int,
        default=0,
        help="bytes of RAM cache (1 MiB blocks) for the capped-link dataset: the loader's next batches are "
        "fetched ahead into it (default 0: none); smaller than the dataset, so the link is what is measured",
    )
    p.add_argument(
        "--htb-inflight",
        type=int,
        default=HTB_INFLIGHT,
        help=f"the capped-link loader's batches in flight (default {HTB_INFLIGHT}, RemoteLoader's default)",
    )
    p.add_argument("--quick", action="store_true", help="4096 samples, 2 s a row, latencies 0,10 (unless given)")
    p.add_argument("--json", type=Path, help="write the results here")
    return p


def print_result(result: dict) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    console = Console(width=max(Console().width, 110))  # piped, rich assumes 80 columns
    table = Table(
        "path",
        "shuffle",
        "ms/request",
        "samples/s",
        "MB/s",
        "first s",
        "p99 ms",
        "GETs/batch",
        "× file",
        "× mosaic",
        title=f"{result['samples']} samples × {result['sample_bytes']} B, batch {result['batch']}, "
        f"{result['seconds']:g} s a row, {result['cores']} cores (load {result['load_before'][0]:.1f} at start)",
    )
    for r in result["rows"]:
        head = [r["path"], r["shuffle"], f"{r['latency_ms']:g}" if "latency_ms" in r else "-"]
        if "error" in r:
            table.add_row(*head, f"[red]{r['error'][:60]}[/]", *[""] * 6)
            continue
        table.add_row(
            *head,
            f"{r['samples_per_s']:,.0f}",
            f"{r['mb_per_s']:.1f}",
            f"{r['first_s']:.2f}",
            f"{r['p99_ms']:.1f}",
            f"{r['gets_per_batch']:.1f}",
            f"{r['x_file']:.2f}" if "x_file" in r else "",
            f"{r['x_mosaic']:.2f}" if "x_mosaic" in r else "",
        )
    if result["rows"]:  # none with --hol-only
        console.print(table)
    hol = result.get("head_of_line")
    if hol and "error" in hol:
        console.print(f"[red]head-of-line: {hol['error']}[/]")
    elif hol:
        hol_table = Table(
            "file loader (full)",
            "p50 ms",
            "p99 ms",
            "max ms",
            "samples/s",
            title=f"head-of-line: file at a {hol['step_ms']:g} ms step, alone and beside a loader reading http "
            f"(full, {hol['latency_ms']:g} ms per request)",
        )
        for name in ("alone", "beside"):
            r = hol[name]
            hol_table.add_row(
                name, f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}", f"{r['max_ms']:.1f}", f"{r['samples_per_s']:,.0f}"
            )
        console.print(hol_table)
        slow = hol["slow_loader"]
        console.print(
            f"p99 beside / alone: {hol['p99_ratio']:.1f}x; the http loader got {slow['batches']} batches"
            + (f" and failed: {slow['error']}" if "error" in slow else "")
        )
        if "hello_busy_max_ms" in hol:
            console.print(
                f"a new client, worst of {hol['probes']} while busy: Hello {hol['hello_busy_max_ms']:.0f} ms, "
                f"DatasetInfo {hol['info_busy_max_ms']:.0f} ms (quiet: {hol['hello_quiet_max_ms']:.0f} / "
                f"{hol['info_quiet_max_ms']:.0f} ms)"
            )
    htb = result.get("htb")
    if htb:
        if "error" in htb:
            console.print(f"htb: not measured: {htb['error']}")
        else:
            link = (
                f"; the link carried {htb['link_mb_per_s']:.1f} MB/s in that window, headers included "
                f"({htb['link_fraction_of_cap']:.0%})"
                if "link_mb_per_s" in htb
                else ""
            )
            console.print(
                f"htb {htb['mbit']} Mbit/s cap, {htb['latency_ms']:g} ms per request, block shuffle, "
                f"{htb.get('inflight', HTB_INFLIGHT)} batches in flight"
                + (f" read ahead into {htb['ram_cache'] >> 20} MiB of RAM" if htb.get("ram_cache") else "")
                + ": "
                f"{htb['mb_per_s']:.1f} MB/s of samples = {htb['fraction_of_cap']:.0%} of the cap"
                f" (after the first {htb.get('warmup_batches', 1)} batches){link}"
                + (f" [{htb['note']}]" if "note" in htb else "")
            )


def _ended(signum: int, frame: object) -> None:
    """SIGTERM ends a run through its ``finally`` blocks: services, store and namespaces go with it."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    quick = args.quick
    if args.hol_only:
        if not args.hol:
            p.error("--hol-only and --no-hol leave nothing to run")
        args.mosaic, args.shuffles, args.latencies = False, [], [args.hol_latency_ms]
    args.latencies = args.latencies or ([0.0, 10.0] if quick else [0.0, 10.0, 30.0, 100.0])
    args.samples = args.samples or (4096 if quick else 16384)
    args.seconds = args.seconds or (2.0 if quick else 5.0)
    if args.batch < 1 or args.samples < 4 * args.batch:
        p.error(f"--samples must be at least 4 batches ({4 * args.batch})")
    if args.htb_ram_cache and args.htb_ram_cache >= args.samples * SAMPLE_BYTES:
        p.error("--htb-ram-cache must be smaller than the dataset (--samples × 12,296 B): else RAM is measured")
    if not 1 <= args.htb_inflight <= MAX_HTB_INFLIGHT:
        p.error(f"--htb-inflight is 1 to {MAX_HTB_INFLIGHT} batches, not {args.htb_inflight}")
    if not 0 <= args.hol_busy <= MAX_BUSY_LOOPS:
        p.error(f"--hol-busy is 0 to {MAX_BUSY_LOOPS} busy loops (a core each), not {args.hol_busy}")
    if args.seconds <= 0 or args.workers < 0 or args.step_ms < 0 or args.htb_ram_cache < 0:
        p.error("--seconds must be positive, --workers and --step-ms not negative")
    main_thread = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _ended) if main_thread else None
    try:
        result = run(args)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old)
    print_result(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
