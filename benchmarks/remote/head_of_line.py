"""The head-of-line part: the local dataset's waits per batch alone, while another loader, in a process of its
own, reads the slow remote dataset from the same provider (``beside``), and while it reads it from a provider
of its own (``apart``, the control: what the machine's shared cores add, told apart from what sharing the
provider adds); meanwhile, in every phase, a new client's ``Hello`` and ``DatasetInfo`` timed every
:data:`~benchmarks.remote.cluster.PROBE_EVERY_S` (:func:`head_of_line`). ``--hol-busy N`` runs every phase
beside N busy loops."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
from typing import Any, cast

from benchmarks.remote.checks import Fingerprints, drain
from benchmarks.remote.cluster import (
    FAIL_FAST,
    PROBE_EVERY_S,
    PROBE_TIMEOUT_S,
    REPO,
    ROW_GRACE_S,
    SEED,
    Cluster,
    Store,
    probe_once,
)
from libbus.errors import BusError

__all__ = ["MAX_BUSY_LOOPS", "head_of_line", "slow_child"]


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


def head_of_line(cluster: Cluster, store: Store, args: argparse.Namespace, fp: Fingerprints, slow_uri: str) -> dict:
    """The local dataset's waits alone, beside a loader reading the slow remote dataset (``slow_uri``) from the
    same provider, and beside one reading it from a provider of its own (the control: the machine's share of
    the rise); new clients' Hello and DatasetInfo times meanwhile. ``--hol-busy N``: every phase beside N
    busy loops."""
    loops = busy_loops(args.hol_busy, 4 * args.seconds + 60)
    try:
        return _head_of_line(cluster, store, args, fp, slow_uri) | {"busy_loops": args.hol_busy}
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


class Probing:
    """A new client's ``Hello`` and ``DatasetInfo`` every :data:`PROBE_EVERY_S` on a thread of this process,
    for the length of a ``with`` block. Every phase runs it, so the measured loader shares its process with
    the same probes in each: only the slow loader, and where it reads, differ between them."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.times: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.times.append(probe_once(self.cluster))
            self._stop.wait(PROBE_EVERY_S)

    def __enter__(self) -> Probing:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(PROBE_TIMEOUT_S * 2 + 5)


def _head_of_line(cluster: Cluster, store: Store, args: argparse.Namespace, fp: Fingerprints, slow_uri: str) -> dict:
    step = args.step_ms / 1e3
    out: dict[str, Any] = {"latency_ms": args.hol_latency_ms, "step_ms": args.step_ms}
    with Probing(cluster) as quiet, cluster.loader("file", "full", args.batch) as loader:
        out["alone"] = drain(loader, args.seconds, "file alone", fp, step)
    store.delay(args.hol_latency_ms)
    busy = Probing(cluster)
    row, out["slow_loader"] = _beside(cluster, cluster, busy, args, fp, step, "file beside http")
    if row is None:  # the slow loader failed before its first batch: nothing to measure beside
        out["error"] = f"the http loader read no batch: {out['slow_loader'].get('error', '?')}"
        return out
    out["beside"] = row
    out["p99_ratio"] = row["p99_ms"] / max(out["alone"]["p99_ms"], 1e-3)
    for name, got in (("quiet", quiet.times), ("busy", busy.times)):
        if got:
            out[f"hello_{name}_max_ms"] = max(h for h, _ in got) * 1e3
            out[f"info_{name}_max_ms"] = max(i for _, i in got) * 1e3
    out["probes"] = len(busy.times)
    # the control: the same slow loader and store, the same probes, but the slow dataset served by a provider of
    # its own. What the local loader's p99 gains here is the machine's (cores shared with the store, the
    # remote reads, the other loader), not its provider's: sharing the provider is judged against this
    apart = Cluster(cluster.state.parent / "apart", {"http": slow_uri}, {})
    try:
        row, out["slow_loader_apart"] = _beside(
            cluster, apart, Probing(cluster), args, fp, step, "file beside http on another provider"
        )
    finally:
        apart.stop()
    if row is not None:
        out["apart"] = row
        out["p99_apart_ratio"] = row["p99_ms"] / max(out["alone"]["p99_ms"], 1e-3)
        out["p99_shared_over_apart"] = out["beside"]["p99_ms"] / max(row["p99_ms"], 1e-3)
    return out


def _beside(
    measured: Cluster,
    slow_at: Cluster,
    probing: Probing,
    args: argparse.Namespace,
    fp: Fingerprints,
    step: float,
    where: str,
) -> tuple[dict | None, dict]:
    """The local dataset's waits (read from ``measured``) while another loader, in a process of its own, reads
    the slow dataset from ``slow_at``, with ``probing`` meanwhile: (the row, or None when the slow loader read
    no batch; what the slow loader says of itself)."""
    # the slow loader in a process of its own, as another trainer is: the measured loader's waits are
    # then the provider's, not this process's GIL shared with the other loader's decoding
    cfg = {"endpoint": slow_at.endpoint, "token": slow_at.token, "batch": args.batch}
    code = "import sys; from benchmarks.remote.head_of_line import slow_child; slow_child(sys.argv[1])"
    child = subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    row = None
    slow: dict[str, Any] = {"batches": 0}
    try:
        assert child.stdout is not None
        first = child.stdout.readline()  # its first batch: the provider is busy with it (or it failed)
        if first.strip() == "reading":
            with probing, measured.loader("file", "full", args.batch) as loader:
                row = drain(loader, args.seconds, where, fp, step)
    finally:
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
    return row, slow
