"""The head-of-line part: the local dataset's waits per batch alone, while another loader, in a process of its
own, reads the slow remote dataset from the same provider (``beside``), and while it reads it from a provider
of its own (``apart``, the control: what the machine's shared cores add, told apart from what sharing the
provider adds); meanwhile, in every phase, a new client's ``Hello`` and ``DatasetInfo`` timed every
:data:`~benchmarks.remote.cluster.PROBE_EVERY_S` (:func:`head_of_line`). ``--hol-busy N`` runs every phase
beside N busy loops.

Where the other tenants run (:func:`tenant_cores`). In a cluster the store is other machines, and the other
trainer has cores of its own; only the provider is shared. On one small machine everything shares its
cores, and the measured loader's p99 then rises with the store's and the other trainer's CPU, whatever the
provider does (the ``apart`` control shows how much). So by default the store, the slow loader and the
control's provider run on the last core this process may use, for the length of the part, and the measured
loader and the shared provider on every core (the last one included, where the tenants leave it free):
what the figure then shows is the shared provider's. ``--hol-share-cores`` leaves every process on every
core.

The measured dataset is :data:`LOCAL`: the benchmark's files held in the provider's RAM (``memory=ram``), not
read through the page cache as the ``file`` rows' are. A kernel that reclaims cold page cache (this project's
VMs run DAMON with ``pageout``) sends some of a page-cache dataset's batches to the disk, 30-90 ms each,
alone as beside; the part measures the provider, not the disk."""

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

__all__ = ["LOCAL", "MAX_BUSY_LOOPS", "cores_of", "head_of_line", "place", "slow_child", "tenant_cores"]


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
    got["cores"] = cores_of(os.getpid())  # where its threads ran (the tenants' cores, or every core)
    print(json.dumps(got), flush=True)


#: The head-of-line part's measured dataset: the local files, in the provider's RAM (the module docstring).
LOCAL = "local"

#: The most busy loops ``--hol-busy`` starts (each spins a core: more only starves the machine).
MAX_BUSY_LOOPS = 64


def busy_loops(n: int, seconds: float) -> list[subprocess.Popen]:
    """``n`` processes spinning a core each, every one ending by itself after ``seconds`` at most (a
    deliberate load, bounded in time whatever happens to this process)."""
    code = "import sys, time\nt = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < t: pass"
    return [subprocess.Popen([sys.executable, "-c", code, str(seconds)]) for _ in range(n)]


def tenant_cores(share: bool) -> list[int] | None:
    """The cores the other tenants run on (the module docstring): the last core this process may use, or
    None (every core) with ``share`` or on a machine of one core."""
    mine = sorted(os.sched_getaffinity(0))
    return None if share or len(mine) < 2 else mine[-1:]


def cores_of(pid: int) -> list[int]:
    """The cores any thread of process ``pid`` may run on."""
    cores: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            cores |= os.sched_getaffinity(int(tid))
        except ProcessLookupError:
            pass
    return sorted(cores)


#: Passes :func:`place` makes over a process's threads (a thread started by one not yet placed is found on
#: the next pass); bounded, whatever the process does.
PLACE_PASSES = 8


def place(pid: int, cores: list[int] | set[int]) -> None:
    """Every thread of process ``pid`` onto ``cores`` (threads it starts later inherit their starter's); a
    thread that ended meanwhile is skipped."""
    done: set[str] = set()
    for _ in range(PLACE_PASSES):
        tids = set(os.listdir(f"/proc/{pid}/task")) - done
        if not tids:
            return
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), cores)
            except ProcessLookupError:
                pass
        done |= tids


def head_of_line(cluster: Cluster, store: Store, args: argparse.Namespace, fp: Fingerprints, slow_uri: str) -> dict:
    """The local dataset's waits alone, beside a loader reading the slow remote dataset (``slow_uri``) from the
    same provider, and beside one reading it from a provider of its own (the control: the machine's share of
    the rise); new clients' Hello and DatasetInfo times meanwhile. ``--hol-busy N``: every phase beside N
    busy loops. The store runs on :func:`tenant_cores` for the part's length."""
    loops = busy_loops(args.hol_busy, 4 * args.hol_seconds + 60)
    tenants = tenant_cores(args.hol_share_cores)
    if tenants is not None:
        place(store.proc.pid, tenants)
    try:
        out = _head_of_line(cluster, store, args, fp, slow_uri, tenants)
        return out | {"busy_loops": args.hol_busy, "tenant_cores": tenants, "store_cores": cores_of(store.proc.pid)}
    finally:
        if tenants is not None and store.proc.poll() is None:
            place(store.proc.pid, os.sched_getaffinity(0))
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


def _head_of_line(
    cluster: Cluster, store: Store, args: argparse.Namespace, fp: Fingerprints, slow_uri: str, tenants: list[int] | None
) -> dict:
    step = args.step_ms / 1e3
    out: dict[str, Any] = {"latency_ms": args.hol_latency_ms, "step_ms": args.step_ms, "seconds": args.hol_seconds}
    with Probing(cluster) as quiet, cluster.loader(LOCAL, "full", args.batch) as loader:
        out["alone"] = drain(loader, args.hol_seconds, "local alone", fp, step)
    store.delay(args.hol_latency_ms)
    busy = Probing(cluster)
    # the shared provider's full garbage collections while it serves both (no Python code of it runs in one)
    collected = cluster.full_collections()
    row, out["slow_loader"] = _beside(cluster, cluster, busy, args, fp, step, "local beside http", tenants)
    out["gc_full_beside"] = cluster.full_collections().since(collected)
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
    apart = Cluster(cluster.state.parent / "apart", {"http": slow_uri}, {}, _on(tenants))
    try:
        row, out["slow_loader_apart"] = _beside(
            cluster, apart, Probing(cluster), args, fp, step, "local beside http on another provider", tenants
        )
    finally:
        apart.stop()
    if row is not None:
        out["apart"] = row
        out["p99_apart_ratio"] = row["p99_ms"] / max(out["alone"]["p99_ms"], 1e-3)
        out["p99_shared_over_apart"] = out["beside"]["p99_ms"] / max(row["p99_ms"], 1e-3)
    return out


def _on(cores: list[int] | None) -> tuple[str, ...]:
    """A command prefix that runs a process, and every thread it starts, on ``cores`` (None: no prefix)."""
    return () if cores is None else ("taskset", "--cpu-list", ",".join(map(str, cores)))


def _beside(
    measured: Cluster,
    slow_at: Cluster,
    probing: Probing,
    args: argparse.Namespace,
    fp: Fingerprints,
    step: float,
    where: str,
    tenants: list[int] | None,
) -> tuple[dict | None, dict]:
    """The local dataset's waits (read from ``measured``) while another loader, in a process of its own on
    ``tenants`` (None: every core), reads the slow dataset from ``slow_at``, with ``probing`` meanwhile: (the
    row, or None when the slow loader read no batch; what the slow loader says of itself)."""
    # the slow loader in a process of its own, as another trainer is: the measured loader's waits are
    # then the provider's, not this process's GIL shared with the other loader's decoding
    cfg = {"endpoint": slow_at.endpoint, "token": slow_at.token, "batch": args.batch}
    code = "import sys; from benchmarks.remote.head_of_line import slow_child; slow_child(sys.argv[1])"
    child = subprocess.Popen(
        [*_on(tenants), sys.executable, "-c", code, json.dumps(cfg)],
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
            with probing, measured.loader(LOCAL, "full", args.batch) as loader:
                row = drain(loader, args.hol_seconds, where, fp, step)
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
