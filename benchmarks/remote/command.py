"""Data behind a network: a provider reading a store with a fixed delay per request, and its local
datasets beside it.

The command (``python -m benchmarks.remote``, ``busctl bench --remote``): its options and their checks
(:func:`parser`, :func:`main`), the run (:func:`benchmarks.remote.rows.run`) and the tables it prints
(:func:`print_result`). What each row measures: :mod:`benchmarks.remote`.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from pathlib import Path

from benchmarks.remote.capped_link import HTB_INFLIGHT, MAX_HTB_INFLIGHT
from benchmarks.remote.checks import SAMPLE_BYTES
from benchmarks.remote.head_of_line import MAX_BUSY_LOOPS
from benchmarks.remote.rows import run

__all__ = ["main", "parser", "print_result"]


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
    p.add_argument(
        "--settle-s",
        type=float,
        help="each row first reads this long uncounted, as an hours-long job's window has grown by then "
        "(default 3; --quick: 1)",
    )
    p.add_argument("--batch", type=int, default=256)
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="the mosaic row's DataLoader workers (default 0: see docs/performance.md)",
    )
    p.add_argument("--hol-latency-ms", type=float, default=30.0, help="the slow dataset's delay, head-of-line part")
    p.add_argument(
        "--hol-seconds",
        type=float,
        help="each head-of-line phase's window (default 3 × --seconds: its p99 is then the 15th-longest of "
        "about 1,400 waits at a 10 ms step, not the 5th of 480)",
    )
    p.add_argument("--step-ms", type=float, default=10.0, help="the local loader's step, head-of-line part")
    p.add_argument(
        "--hol-busy",
        type=int,
        default=0,
        help="busy loops (a process spinning a core each) beside both head-of-line phases: a deliberate load",
    )
    p.add_argument(
        "--hol-share-cores",
        action="store_true",
        help="the head-of-line part's store, other loader and control provider share every core with the measured "
        "loader (default: they run on the last core, as the other machines and cores of a cluster)",
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
        help="the capped-link loader's batches in flight (default 0: the loader sizes its window, RemoteLoader's default)",
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
            "local loader (full, RAM)",
            "p50 ms",
            "p99 ms",
            "max ms",
            "samples/s",
            title=f"head-of-line: a local dataset at a {hol['step_ms']:g} ms step, alone and beside a loader reading http "
            f"(full, {hol['latency_ms']:g} ms per request) from the same provider, or apart: from another; "
            f"{hol.get('seconds', 0):g} s each",
        )
        for name in ("alone", "beside", "apart"):
            if name not in hol:
                continue
            r = hol[name]
            hol_table.add_row(
                name, f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}", f"{r['max_ms']:.1f}", f"{r['samples_per_s']:,.0f}"
            )
        console.print(hol_table)
        tenants = hol.get("tenant_cores")
        console.print(
            f"the store, the http loader and the control's provider ran on core {','.join(map(str, tenants))}, as "
            "other machines (--hol-share-cores: on every core)"
            if tenants
            else "every process ran on every core"
        )
        slow = hol["slow_loader"]
        console.print(
            f"p99 beside / alone: {hol['p99_ratio']:.1f}x; the http loader got {slow['batches']} batches"
            + (f" and failed: {slow['error']}" if "error" in slow else "")
        )
        if "apart" in hol:
            console.print(
                f"p99 apart / alone: {hol['p99_apart_ratio']:.1f}x (the machine's share: the slow loader on a "
                f"provider of its own); beside / apart: {hol['p99_shared_over_apart']:.1f}x (the shared provider's)"
            )
        if "hello_busy_max_ms" in hol:
            console.print(
                f"a new client, worst of {hol['probes']} while busy: Hello {hol['hello_busy_max_ms']:.0f} ms, "
                f"DatasetInfo {hol['info_busy_max_ms']:.0f} ms (quiet: {hol['hello_quiet_max_ms']:.0f} / "
                f"{hol['info_quiet_max_ms']:.0f} ms)"
            )
        if "gc_full_beside" in hol:
            gc = hol["gc_full_beside"]
            console.print(
                f"the shared provider's full garbage collections beside: {gc['collections']:.0f}, "
                f"{gc['ms']:.1f} ms in all"
                + (f", each at most {gc['each_at_most_ms']:g} ms" if gc["collections"] else "")
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
                + (
                    f"{htb['inflight']} batches in flight"
                    if htb.get("inflight")
                    else f"the window the loader sized ({htb.get('inflight_at_end', '?')} batches in flight at the end)"
                )
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
    args.settle_s = (1.0 if quick else 3.0) if args.settle_s is None else args.settle_s
    args.hol_seconds = args.hol_seconds or 3 * args.seconds
    if args.batch < 1 or args.samples < 4 * args.batch:
        p.error(f"--samples must be at least 4 batches ({4 * args.batch})")
    if args.htb_ram_cache and args.htb_ram_cache >= args.samples * SAMPLE_BYTES:
        p.error("--htb-ram-cache must be smaller than the dataset (--samples × 12,296 B): else RAM is measured")
    if not 0 <= args.htb_inflight <= MAX_HTB_INFLIGHT:
        p.error(f"--htb-inflight is 0 (the loader sizes it) to {MAX_HTB_INFLIGHT} batches, not {args.htb_inflight}")
    if not 0 <= args.hol_busy <= MAX_BUSY_LOOPS:
        p.error(f"--hol-busy is 0 to {MAX_BUSY_LOOPS} busy loops (a core each), not {args.hol_busy}")
    if (
        args.seconds <= 0
        or args.hol_seconds <= 0
        or args.workers < 0
        or args.step_ms < 0
        or args.htb_ram_cache < 0
        or args.settle_s < 0
    ):
        p.error("--seconds and --hol-seconds must be positive, --workers, --step-ms and --settle-s not negative")
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
