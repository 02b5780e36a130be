"""The delivery benchmark's targets and tables (:mod:`benchmarks.delivery` measures, this judges and prints).

With ``--repeat N`` the same rows are measured N times in one invocation (one dataset, one set of
services), each repeat's ratios within that repeat; a target counts as met only when every repeat
meets it, and the summary gives each ratio's minimum and median, never the best repeat alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["CHECKS", "add_ratios", "checks", "print_result", "summarize"]


@dataclass(frozen=True)
class Check:
    name: str
    target: str
    unit: str  # "x": a multiple; "%": a fraction shown as a percentage
    threshold: float
    value: Callable[[dict], float]

    def show(self, v: float) -> str:
        return f"{v:.0%}" if self.unit == "%" else f"{v:.2f}x" if v < 2 else f"{v:.1f}x"


def _gb(base: dict, a: str, b: str) -> float:
    return base[a]["gb_per_s"] / base[b]["gb_per_s"]


#: The issues' targets, each a ratio of two rows measured in the same repeat.
CHECKS = [
    Check("shm (valid while held) vs shm copy=True (GB/s)", ">= 1x", "x", 1.0, lambda b: _gb(b, "shm", "shm-copy")),
    Check(
        "shm vs DataLoader (samples/s)",
        ">= 5x",
        "x",
        5.0,
        lambda b: b["shm"]["samples_per_s"] / b["dataloader"]["samples_per_s"],
    ),
    Check("shm vs memcpy (GB/s)", ">= 80%", "%", 0.8, lambda b: _gb(b, "shm", "memcpy")),
    Check("socket vs raw pyzmq (GB/s)", ">= 70%", "%", 0.7, lambda b: _gb(b, "socket", "pyzmq")),
]


def add_ratios(rows: list[dict]) -> dict:
    """Each row's ratio to the DataLoader and to memcpy (and to memcpy-ring when measured) of its
    own repeat. Returns the rows by name."""
    base = {r["path"]: r for r in rows}
    for r in rows:
        r["x_dataloader"] = r["samples_per_s"] / base["dataloader"]["samples_per_s"]
        r["x_memcpy"] = r["gb_per_s"] / base["memcpy"]["gb_per_s"]
        if "memcpy-ring" in base:
            r["x_memcpy_ring"] = r["gb_per_s"] / base["memcpy-ring"]["gb_per_s"]
    return base


def checks(repeats: list[list[dict]]) -> list[dict]:
    """Every target over every repeat: met only if met in each; value = the worst and the median."""
    out = []
    for c in CHECKS:
        values = [c.value({r["path"]: r for r in rows}) for rows in repeats]
        worst, median = min(values), statistics.median(values)
        shown = c.show(worst) if len(values) == 1 else f"min {c.show(worst)}, median {c.show(median)} of {len(values)}"
        out.append({"check": c.name, "target": c.target, "value": shown, "values": values, "ok": worst >= c.threshold})
    return out


def summarize(repeats: list[list[dict]]) -> list[dict]:
    """Per row over the repeats: median samples/s and GB/s, min/median of its ratios."""
    out = []
    for i, first in enumerate(repeats[0]):
        rows = [rows[i] for rows in repeats]
        row = {"path": first["path"], "repeats": len(rows)}
        for key in ("samples_per_s", "gb_per_s", "p50_ms", "p99_ms"):
            row[key] = statistics.median(r[key] for r in rows)
        for key in ("x_dataloader", "x_memcpy", "x_memcpy_ring"):
            if key in first:
                values = [r[key] for r in rows]
                row[key] = {"min": min(values), "median": statistics.median(values), "max": max(values)}
        out.append(row)
    return out


def print_result(result: dict) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    console = Console(width=max(Console().width, 100))  # piped, rich assumes 80 columns
    ring = any("x_memcpy_ring" in r for r in result["rows"])
    table = Table(
        "path",
        "samples/s",
        "GB/s",
        "p50 ms",
        "p99 ms",
        "× DataLoader",
        "× memcpy",
        *(["× ring"] if ring else []),
        title=f"{result['samples']} samples × {result['sample_bytes']} B "
        f"({result['dataset_mb']:.0f} MiB), batch {result['batch']}, {result['epochs']} epoch(s)"
        + (" — first repeat" if len(result.get("repeats", [])) > 1 else ""),
    )
    for r in result["rows"]:
        table.add_row(
            r["path"],
            f"{r['samples_per_s']:,.0f}",
            f"{r['gb_per_s']:.2f}",
            f"{r['p50_ms']:.2f}",
            f"{r['p99_ms']:.2f}",
            f"{r['x_dataloader']:.1f}",
            f"{r['x_memcpy']:.0%}",
            *([f"{r['x_memcpy_ring']:.0%}"] if ring else []),
        )
    console.print(table)
    if len(result.get("repeats", [])) > 1:
        _print_summary(console, Table, result, ring)
    if "wait" in result:
        wait = Table(
            "path",
            "samples/s",
            "waiting for data",
            "next() µs/batch",
            "of it CPU µs",
            title=f"trainer loop: {result['wait']['work_ms']:.0f} ms of CPU work per step",
        )
        for r in result["wait"]["rows"]:
            wait.add_row(
                r["path"],
                f"{r['samples_per_s']:,.0f}",
                f"{r['wait_fraction']:.2%}",
                f"{r['next_us']:.0f}",
                f"{r['next_cpu_us']:.0f}",
            )
        console.print(wait)
    for c in result["checks"]:
        mark = "[green]ok[/]" if c["ok"] else "[red]missed[/]"
        console.print(f"{mark}  {c['check']}: {c['value']} (target {c['target']})")


def _print_summary(console, Table, result: dict, ring: bool) -> None:
    def span(d: dict, pct: bool) -> str:
        show = (lambda v: f"{v:.0%}") if pct else (lambda v: f"{v:.1f}")
        return f"{show(d['min'])} / {show(d['median'])} / {show(d['max'])}"

    table = Table(
        "path",
        "samples/s",
        "× DataLoader",
        "× memcpy",
        *(["× memcpy-ring"] if ring else []),
        title=f"over {len(result['repeats'])} repeats: median samples/s, ratios min / median / max "
        "(each within its repeat)",
    )
    for r in result["summary"]:
        table.add_row(
            r["path"],
            f"{r['samples_per_s']:,.0f}",
            span(r["x_dataloader"], False),
            span(r["x_memcpy"], True),
            *([span(r["x_memcpy_ring"], True)] if ring else []),
        )
    console.print(table)
