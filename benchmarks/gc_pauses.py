"""The provider's garbage collections, with what start-up built frozen (``gc_freeze``, the default) and not.

No Python code of a process runs during a garbage collection (it holds the GIL): not the serving loop,
not a reply. A full (generation 2) collection walks every object the collector tracks, start-up's tens of
thousands included, unless they were frozen (:func:`services.process.freeze_startup_heap`). Each round starts a
router and a provider (``busctl start``) serving one dataset from a file, once with ``gc_freeze`` off and
once on (alternated, ``--repeat`` rounds), and reads it with block and then full shuffle for ``--seconds``
each, as fast as it comes, while a new client says ``Hello`` every 0.25 s. Per provider: its full
collections while read (from its ``/metrics``: how many, their milliseconds in all, the bucket the
longest fell in), the objects frozen, each shuffle's samples/s and p99 wait, and the slowest ``Hello``.

    python -m benchmarks.gc_pauses [--samples 16384] [--seconds 5] [--repeat 2] [--json FILE]

Timings are this machine's of the moment: compare the two settings within a run, never across runs."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.remote.checks import Fingerprints, drain
from benchmarks.remote.cluster import Cluster
from benchmarks.remote.head_of_line import Probing

__all__ = ["main", "one_provider"]


def frozen_objects(cluster: Cluster) -> int:
    """The provider's ``batchbus_gc_frozen_objects``."""
    samples = cluster.metric("batchbus_gc_frozen_objects")
    if not samples:
        raise RuntimeError("the provider exports no batchbus_gc_frozen_objects")
    return int(samples[0].value)


def one_provider(root: Path, state: Path, freeze: bool, args: argparse.Namespace, fp: Fingerprints) -> dict:
    """A fresh router and provider with ``gc_freeze`` = ``freeze``, read with each shuffle in turn."""
    env = {"BATCHBUS_GC_FREEZE": "true" if freeze else "false"}
    cluster = Cluster(state, {"file": f"file://{root}?memory=stream&val_fraction=0"}, env)
    try:
        out: dict = {"gc_freeze": freeze, "frozen_objects": frozen_objects(cluster)}
        before = cluster.full_collections()
        with Probing(cluster) as probes:
            for shuffle in ("block", "full"):
                with cluster.loader("file", shuffle, args.batch) as loader:
                    out[shuffle] = drain(loader, args.seconds, f"file ({shuffle})", fp, settle_s=1.0)
        out["full_collections"] = cluster.full_collections().since(before)
        out["hello_max_ms"] = max((h for h, _ in probes.times), default=0.0) * 1e3
        return out
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gc_pauses", description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=16384, help="dataset size (default 16384: 192 MiB)")
    parser.add_argument("--seconds", type=float, default=5.0, help="each shuffle's window (default 5)")
    parser.add_argument("--repeat", type=int, default=2, help="rounds, each both settings (default 2)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.samples < args.batch or args.seconds <= 0 or args.repeat < 1 or args.batch < 1:
        parser.error("--samples must hold a batch; --seconds, --repeat and --batch must be positive")
    import numpy as np  # noqa: PLC0415

    from benchmarks.delivery import make_dataset  # noqa: PLC0415

    work = Path(tempfile.mkdtemp(prefix="batchbus-gc-"))
    try:
        root = work / "data"
        root.mkdir()
        make_dataset(root, args.samples)
        fp = Fingerprints(np.load(root / "train_x.npy"), np.load(root / "train_y.npy"))
        runs = []
        for round_ in range(args.repeat):
            for freeze in (False, True):
                run = one_provider(root, work / f"state-{round_}-{int(freeze)}", freeze, args, fp)
                runs.append(run)
                gc = run["full_collections"]
                print(
                    f"gc_freeze={str(freeze).lower():5}  frozen {run['frozen_objects']:>6,}  "
                    f"full collections {gc['collections']:>3.0f}, {gc['ms']:6.1f} ms in all, "
                    f"each at most {gc['each_at_most_ms']:g} ms  |  "
                    + "  ".join(
                        f"{s} {run[s]['samples_per_s']:>9,.0f}/s p99 {run[s]['p99_ms']:5.1f} ms"
                        for s in ("block", "full")
                    )
                    + f"  |  Hello at worst {run['hello_max_ms']:.0f} ms",
                    flush=True,
                )
        if args.json:
            args.json.write_text(json.dumps({"samples": args.samples, "seconds": args.seconds, "runs": runs}, indent=1))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
