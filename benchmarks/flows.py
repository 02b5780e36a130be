"""Two flows against one, through a link that caps every TCP connection separately.

Two network namespaces joined by a veth pair stand for two hosts: a router and a provider in one,
a loader in the other. On the provider's end of the link an ``htb`` qdisc holds one class per port
of the loader's (narrowed) ephemeral port range, each capped at ``--rate`` Mbit/s and chosen by a
``u32`` filter on the TCP destination port: every connection the loader opens is shaped on its own,
as a cloud NIC caps each flow (this kernel has ``htb`` and ``u32``, not ``fq``). The loader reads a
generated dataset (``dummy://``, zeros) with ``flows=1`` and with ``flows=2`` in turn, ``--repeat``
times, in one run; reported: samples/s of each row (median over repeats), the ratio flows=2 ÷
flows=1 per repeat (target ≥ 1.8), and how many capped classes carried each row's batches.

    sudo python -m benchmarks.flows --seconds 10 --repeat 3 --json flows.json

Needs root (namespaces, qdiscs); everything it makes is removed at the end. Bounded in time: each
row reads for ``--seconds`` after its first batch, and every process it starts is waited for with a
timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import netns
from benchmarks.netns import netns_unavailable
from benchmarks.remote.cluster import REPO, Cluster

__all__ = ["CappedLink", "Services", "main", "measure", "run"]

#: The loader's ephemeral ports: one capped class each (a run opens a few connections per row).
PORTS = range(42000, 42064)
PROVIDER_ADDR, LOADER_ADDR = "10.214.0.1", "10.214.0.2"


class CappedLink(netns.CappedLink):
    """Namespaces ``<tag>-p`` (provider) and ``<tag>-l`` (loader) joined by veth ``vp``—``vl``; every
    connection from the loader's ports :data:`PORTS` shaped on ``vp`` (provider → loader) to
    ``rate_mbit`` by a class of its own."""

    def __init__(self, rate_mbit: int):
        hosts = (("p", "vp", PROVIDER_ADDR), ("l", "vl", LOADER_ADDR))
        super().__init__(f"bbf{secrets.token_hex(2)}", hosts, rate_mbit, ports=PORTS)
        self.provider, self.loader = self.a, self.b


class Services(Cluster):
    """A router and a provider of ``datasets`` (``NAME=URI``) in the provider's namespace, as
    ``busctl start`` processes, the provider listening at the link's address; a trainer token scoped to
    those datasets."""

    def __init__(self, link: CappedLink, state: Path, datasets: list[str]):
        named = {name: uri for name, _, uri in (d.partition("=") for d in datasets)}
        env = {"BATCHBUS_TORCH_THREADS": "1"}
        bind = ("--bind", f"tcp://{PROVIDER_ADDR}:0")
        super().__init__(state, named, env, link.exec(link.provider), provider_args=bind)


def measure(link: CappedLink, services: Services, dataset: str, flows: int, args: dict, timeout_s: float) -> dict:
    """One row: a loader process in the loader's namespace reading ``dataset`` with ``flows``
    (see :func:`_loader_main`); its result, plus the bytes each capped class carried meanwhile."""
    before = link.class_bytes()
    cmd = [*link.exec(link.loader), sys.executable, "-m", "benchmarks.flows", "loader", "--flows", str(flows)]
    cmd += ["--endpoint", services.endpoint, "--dataset", dataset, "--args", json.dumps(args)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "BATCHBUS_TOKEN": services.token}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(f"loader with flows={flows} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    after = link.class_bytes()
    carried = sorted((after[c] - before.get(c, 0) for c in after), reverse=True)
    result["class_bytes"] = [b for b in carried if b > 0]
    # a class that carried a batch's worth: a connection the batches travelled on
    result["classes_used"] = sum(b >= args.get("batch_bytes", 1) for b in carried)
    return result


def _loader_main(ns: argparse.Namespace) -> None:
    """In the loader's namespace: read for ``seconds`` after the first batch (or ``epochs`` whole
    epochs, each checked sample for sample against ``verify``'s source); print one JSON line."""
    import numpy as np  # noqa: PLC0415 - torch and the loader load in this process only

    from libbus.loader.remote import RemoteLoader  # noqa: PLC0415

    args = json.loads(ns.args)
    with RemoteLoader(
        ns.dataset,
        provider=ns.endpoint,
        token=os.environ["BATCHBUS_TOKEN"],
        batch_size=args["batch"],
        inflight=args["inflight"],
        flows=ns.flows,
        shuffle="full",
        drop_last=not args.get("verify"),
        shm=False,
        host_id="flows-bench-loader",  # namespaces share /etc/machine-id: say this is another host
    ) as loader:
        out: dict = {"flows": loader.flows, "connections": len(loader.replicas)}
        if args.get("verify"):
            from services.provider.sources import open_source  # noqa: PLC0415

            source, exact = open_source(args["verify"]), True
            for epoch in range(args.get("epochs", 1)):
                xs, ys = zip(*((x.numpy().copy(), y.numpy().copy()) for x, y in loader))
                want_x, want_y = source.read("train", loader.order(epoch))
                exact &= bool(np.array_equal(np.concatenate(xs), want_x) and np.array_equal(np.concatenate(ys), want_y))
            out["exact"] = exact
        else:
            samples, start, end = 0, 0.0, 0.0
            while not end:
                for x, _ in loader:
                    now = time.monotonic()
                    if not start:
                        start = now  # the clock starts at the first batch: connections are up
                        continue
                    samples += len(x)
                    if now - start >= args["seconds"]:
                        end = now
                        break
            out.update(samples=samples, seconds=end - start, samples_per_s=samples / (end - start))
        out["received"] = [r.received for r in loader.replicas]
    print(json.dumps(out))


def run(args: argparse.Namespace) -> dict:
    shape = ",".join(str(s) for s in args.shape)
    sample_bytes = int(__import__("math").prod(args.shape)) + 8  # uint8 sample + int64 label
    uri = f"dummy://?shape={shape}&n={args.samples}&dtype=uint8"
    largs = {"batch": args.batch, "inflight": args.inflight, "seconds": args.seconds}
    largs["batch_bytes"] = args.batch * sample_bytes
    link = CappedLink(args.rate)
    root = Path(tempfile.mkdtemp(prefix="batchbus-flows-"))
    services = None
    rows: list[dict] = []
    try:
        services = Services(link, root, [f"flows={uri}"])
        for repeat in range(args.repeat):
            for flows in (1, 2):
                row = measure(link, services, "flows", flows, largs, args.seconds + 120)
                row.update(repeat=repeat, mb_per_s=row["samples_per_s"] * sample_bytes / 1e6)
                rows.append(row)
                print(
                    f"repeat {repeat + 1}, flows={flows}: {row['samples_per_s']:,.0f} samples/s, "
                    f"{row['mb_per_s']:.1f} MB/s, {row['classes_used']} capped class(es) used",
                    flush=True,
                )
    finally:
        if services is not None:
            services.stop()
        link.close()
        shutil.rmtree(root, ignore_errors=True)
    by_flows = {n: [r for r in rows if r["flows"] == n] for n in (1, 2)}
    ratios = [two["samples_per_s"] / one["samples_per_s"] for one, two in zip(by_flows[1], by_flows[2])]
    return {
        "rate_mbit_per_flow": args.rate,
        "batch": args.batch,
        "batch_mb": largs["batch_bytes"] / 1e6,
        "inflight": args.inflight,
        "seconds": args.seconds,
        "rows": rows,
        "median_samples_per_s": {n: statistics.median(r["samples_per_s"] for r in rs) for n, rs in by_flows.items()},
        "ratios": ratios,
        "ratio_median": statistics.median(ratios),
        "ok": min(ratios) >= 1.8,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.flows", description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=int, default=200, help="Mbit/s each connection is capped at")
    p.add_argument("--shape", type=int, nargs="+", default=[3, 128, 128], help="uint8 sample shape")
    p.add_argument("--samples", type=int, default=1024, help="dataset size")
    p.add_argument("--batch", type=int, default=128, help="batch size (default: 6.3 MB batches)")
    p.add_argument("--inflight", type=int, default=4)
    p.add_argument("--seconds", type=float, default=10.0, help="each row's measured window")
    p.add_argument("--repeat", type=int, default=3, help="flows=1 then flows=2, this many times")
    p.add_argument("--json", type=Path, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["loader"]:  # the loader's side, started by measure() in the loader's namespace
        lp = argparse.ArgumentParser(prog="python -m benchmarks.flows loader")
        lp.add_argument("--flows", type=int, required=True)
        lp.add_argument("--endpoint", required=True)
        lp.add_argument("--dataset", required=True)
        lp.add_argument("--args", required=True)
        _loader_main(lp.parse_args(argv[1:]))
        return None
    args = parser().parse_args(argv)
    why = netns_unavailable()
    if why:
        parser().error(why)
    if args.seconds <= 0 or args.repeat < 1 or args.samples < 2 * args.batch:
        parser().error("--seconds must be positive, --repeat at least 1, --samples at least 2 batches")
    r = run(args)
    one, two = r["median_samples_per_s"][1], r["median_samples_per_s"][2]
    print(
        f"each connection capped at {r['rate_mbit_per_flow']} Mbit/s, batches of {r['batch_mb']:.1f} MB: "
        f"flows=1 {one:,.0f} samples/s, flows=2 {two:,.0f} samples/s (medians of {len(r['ratios'])}); "
        f"flows=2 / flows=1 = {r['ratio_median']:.2f} (each repeat: {', '.join(f'{x:.2f}' for x in r['ratios'])}; "
        f"target >= 1.8: {'met' if r['ok'] else 'NOT met'})"
    )
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))
    return r


if __name__ == "__main__":
    main()
