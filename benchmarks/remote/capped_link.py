"""The capped-link row (``--htb``, root only): the store in a network namespace of its own behind a veth
whose store end sends at most ``--htb-mbit`` through one ``htb`` class (the link's cap, not a flow's), the
router, provider and loader in another; block shuffle's payload MB/s as a fraction of the cap over the
loader's steady window, beside what the link's own byte counter saw cross in that window
(:func:`htb_row`). The namespaces and the qdisc are :class:`benchmarks.netns.CappedLink`'s."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any, cast

import numpy as np

from benchmarks.netns import CappedLink, netns_unavailable
from benchmarks.remote.checks import Fingerprints, drain
from benchmarks.remote.cluster import REPO, ROW_GRACE_S, SEED, Cluster, Store, end_child

__all__ = ["HTB_INFLIGHT", "MAX_HTB_INFLIGHT", "StoreLink", "htb_child", "htb_row"]

#: The store's and the provider's ends of the capped veth.
STORE_ADDR, PROVIDER_ADDR = "10.215.0.1", "10.215.0.2"
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
        end_child(self.proc, 10)
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


class StoreLink(CappedLink):
    """Namespaces ``<tag>-s`` (the store) and ``<tag>-p`` (router, provider, loader) joined by a veth
    whose store end sends at most ``mbit`` (one ``htb`` class for all its traffic: the cap is the
    link's, not a flow's). Deleted by :meth:`close`, which the caller always calls."""

    def __init__(self, mbit: int):
        super().__init__(f"bbr{os.getpid() % 100000}", (("s", "vs", STORE_ADDR), ("p", "vp", PROVIDER_ADDR)), mbit)
        self.store, self.provider = self.a, self.b

    def count_sent(self) -> LinkCounter:
        """The store end's bytes sent, read every :data:`LINK_EVERY_S` until closed (:class:`LinkCounter`)."""
        return LinkCounter(self.exec(self.store))


#: The capped-link loader's batches in flight by default: 0, the loader sizes its window (RemoteLoader's
#: default, ``inflight=None``); ``--htb-inflight`` sets it.
HTB_INFLIGHT = 0
#: The most batches in flight ``--htb-inflight`` takes (each holds a batch of 256 samples, 3 MB, in the loader).
MAX_HTB_INFLIGHT = 64


def htb_child(cfg_json: str) -> None:
    """In the provider's namespace: read ``http`` with block shuffle for ``seconds``; print one JSON line."""
    from libbus.loader import window_size  # noqa: PLC0415
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
        inflight=cfg["inflight"] or None,
    ) as loader:
        # the first batches counted, asked for together, are skipped: their bytes mostly crossed before the
        # first arrived
        warmup = cfg["inflight"] or window_size.START
        row = drain(loader, cfg["seconds"], "http behind htb", fp, warmup=warmup, settle_s=cfg["settle_s"])
        row["inflight_at_end"] = loader.inflight
    print(json.dumps(row), flush=True)


def htb_row(root: Path, work: Path, args: argparse.Namespace) -> dict:
    """Block shuffle from the store behind a veth capped by ``htb`` (:class:`StoreLink`) at
    ``args.htb_latency_ms`` per request: payload MB/s as a fraction of the cap."""
    why = netns_unavailable()
    if why:
        return {"error": why}
    out: dict[str, Any] = {
        "mbit": args.htb_mbit,
        "latency_ms": args.htb_latency_ms,
        "ram_cache": args.htb_ram_cache,
        "inflight": args.htb_inflight,
    }
    link = StoreLink(args.htb_mbit)
    store = cluster = None
    try:
        store = Store(root.parent, None, link.exec(link.store), STORE_ADDR)
        store.delay(args.htb_latency_ms)
        query = f"&ram_cache={args.htb_ram_cache}&block={1 << 20}" if args.htb_ram_cache else ""
        datasets = {"http": f"{store.urls['http']}/{root.name}/?val_fraction=0{query}"}
        cluster = Cluster(work / "htb-state", datasets, {}, link.exec(link.provider))
        cfg = {"root": str(root), "endpoint": cluster.endpoint, "token": cluster.token}
        cfg.update(batch=args.batch, seconds=args.seconds, settle_s=args.settle_s, inflight=args.htb_inflight)
        code = "import sys; from benchmarks.remote.capped_link import htb_child; htb_child(sys.argv[1])"
        counter = link.count_sent()
        try:
            done = subprocess.run(
                [*link.exec(link.provider), sys.executable, "-c", code, json.dumps(cfg)],
                capture_output=True,
                text=True,
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO)},
                timeout=args.settle_s + args.seconds + ROW_GRACE_S + 60,
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
