"""``busctl top``: a live terminal view of providers, trainers, jobs and pipeline stages.

Each refresh takes a *snapshot* from the router (``Stats``, ``ListPeers``, ``ListJobs``: what
``busctl queues``, ``peers`` and ``jobs`` show) and turns it, with the snapshot before it, into a
*frame model* (:func:`frame`): plain data, printed by ``--once --json``. Rates (a provider's
samples/s) come from the difference of two successive snapshots. :func:`render` draws a frame with
rich; it is pure, so a test reads what a terminal would show without one.
"""

from __future__ import annotations

import time
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from libbus.config import Settings
from libbus.connect.client import Client
from libbus.errors import BusError
from libbus.jobs.state import JobState
from libbus.wire.messages import ListJobs, ListPeers, Stats

from .common import SafeConsole, admin_client, print_json, printable
from .tables import epoch_index, refusals, stage_tables, wait_split

__all__ = ["collect", "data_wait_cell", "frame", "render", "top_command"]

#: Jobs that hold a trainer, listed with a progress bar.
ACTIVE_STATES = (JobState.RUNNING, JobState.PAUSED)
#: Queued jobs listed (the rest are counted).
QUEUED_SHOWN = 5


def collect(client: Client) -> dict:
    """One snapshot: every service's Stats, the peers, the active and the first queued jobs."""
    snapshot: dict[str, Any] = {
        "at": time.time(),
        "endpoint": client.endpoint,
        "services": client.request(Stats(), retries=0).services,
        "peers": client.request(ListPeers(), retries=0).peers,
        "jobs": [],
    }
    for state in (*ACTIVE_STATES, JobState.QUEUED):
        limit = QUEUED_SHOWN if state is JobState.QUEUED else 1000
        snapshot["jobs"] += client.request(ListJobs(state=state, limit=limit), retries=0).jobs
    return snapshot


def _rate(now: float, before: float | None, dt: float | None) -> float | None:
    """Per second between two counter readings; None without a previous one (or after a restart)."""
    if before is None or not dt or dt <= 0 or now < before:
        return None
    return (now - before) / dt


def _served(stats: dict) -> dict[str, int]:
    """A provider's totals over its datasets: samples, batches, bytes, evaluations."""
    total = {"samples": 0, "batches": 0, "bytes": 0, "evaluations": 0}
    for counters in (stats.get("datasets") or {}).values():
        for key in total:
            total[key] += int(counters.get(key, 0))
    return total


def _row(services: dict, peer: dict) -> dict | None:
    """A peer's Stats row: its session's (the router keys rows by token subject, not by name; a
    router before that keyed them by name)."""
    row = next((r for r in services.values() if peer.get("session") and r.get("session") == peer["session"]), None)
    return row if row is not None else services.get(peer["name"])


def frame(snapshot: dict, previous: dict | None) -> dict:
    """The frame model: what one refresh shows, as plain data (``busctl top --once --json``)."""
    services, peers = snapshot["services"], snapshot["peers"]
    before = (previous or {}).get("services", {})
    dt = snapshot["at"] - previous["at"] if previous else None
    router = services.get("router", {})
    providers = []
    for peer in sorted((p for p in peers if p["role"] == "provider"), key=lambda p: p["name"]):
        stats = _row(services, peer) or {}
        served = _served(stats)
        old = _row(before, peer)
        earlier = _served(old)["samples"] if old is not None else None
        refused = refusals(stats.get("counters", {}))
        for cause, n in (stats.get("refused") or {}).items():
            refused[cause] = refused.get(cause, 0) + n
        providers.append(
            {
                "name": peer["name"],
                "endpoint": peer.get("endpoint"),
                "datasets": peer.get("datasets", []),
                **served,
                "samples_per_s": _rate(served["samples"], earlier, dt),
                "sessions": stats.get("sessions"),
                "refused": refused,
                "evaluations_running": stats.get("evaluations_running", 0),
            }
        )
    active = [j for j in snapshot["jobs"] if j["state"] in ACTIVE_STATES]
    by_trainer = {j["trainer"]: j for j in active if j.get("trainer")}
    trainers = []
    for peer in sorted((p for p in peers if p["role"] == "trainer"), key=lambda p: p["name"]):
        stats = _row(services, peer) or {}
        job = by_trainer.get(peer["name"])
        p = (job or {}).get("progress") or {}
        trainers.append(
            {
                "name": peer["name"],
                "job": job["id"] if job else stats.get("job"),
                "state": job["state"] if job else "idle",
                "epoch": _epoch(p),
                "epochs": p.get("epochs"),
                "step": p.get("step"),
                "loss": p.get("loss"),
                "samples": p.get("samples"),
                "samples_per_s": p.get("samples_per_s"),
                "data_wait_pct": p.get("data_wait_pct"),
                "data_wait_slowest": p.get("data_wait_slowest") or (p.get("data_wait_split") or {}).get("slowest"),
                "data_wait_split": p.get("data_wait_split"),
                "transport": p.get("transport"),
                "tasks": stats.get("tasks", {}),
            }
        )
    jobs = [_job_row(j) for j in active]
    return {
        "at": snapshot["at"],
        "router": {
            "endpoint": snapshot.get("endpoint"),
            "peers": router.get("peers", {}),
            "sessions": router.get("sessions"),
        },
        "job_counts": router.get("jobs", {}),
        "providers": providers,
        "trainers": trainers,
        "jobs": jobs,
        "queued": [
            {
                "id": j["id"],
                "dataset": j["spec"]["dataset"],
                "model": j["spec"]["model"],
                "priority": j.get("priority", 0),
            }
            for j in snapshot["jobs"]
            if j["state"] == JobState.QUEUED
        ],
        "pipelines": {name: s["pipelines"] for name, s in services.items() if s.get("pipelines")},
    }


def _epoch(p: dict) -> int | None:
    """The 1-based epoch being trained (a finished last epoch stays the last; :func:`.tables.epoch_index`)."""
    index = epoch_index(p)
    return None if index is None else index + 1


def _epoch_cell(epoch: int | None, epochs: int | None) -> str:
    """``N/M``, ``N`` where the job names no total (an entrypoint without an epochs param); ``-`` for N not begun."""
    shown = "-" if epoch is None else str(epoch)
    return f"{shown}/{epochs}" if epochs else shown


def _job_row(job: dict) -> dict:
    p = job.get("progress") or {}
    total = (p.get("epochs") or 0) * (p.get("steps_per_epoch") or 0)
    return {
        "id": job["id"],
        "state": job["state"],
        "trainer": job.get("trainer"),
        "dataset": job["spec"]["dataset"],
        "model": job["spec"]["model"],
        "epoch": _epoch(p),
        # the report's total (none for an entrypoint that names none); the spec's for a built-in job not begun
        "epochs": p.get("epochs") if p else None if job["spec"].get("entrypoint") else job["spec"]["epochs"],
        "step": p.get("step", 0),
        "total_steps": total or None,
        "loss": p.get("loss"),
        "fraction": min(1.0, p.get("step", 0) / total) if total else 0.0,
    }


def data_wait_cell(t: dict) -> str:
    """The data stall: the share of time spent waiting for batches, the replica waited on most, and
    the largest parts of the waiting (provider queueing, read, a stage, transfer)."""
    if t["data_wait_pct"] is None:
        return "-"
    slowest = t.get("data_wait_slowest")
    stalled = t["data_wait_pct"] >= 1
    split = wait_split(t.get("data_wait_split"), parts=2) if stalled else ""
    return (
        f"{t['data_wait_pct']:.1f}%"
        + (f" ({slowest})" if slowest and stalled else "")
        + (f": {split}" if split else "")
    )


def _num(value, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "-"


def render(snapshot: dict, previous: dict | None = None) -> RenderableType:
    """The frame of ``snapshot`` (rates against ``previous``), as a rich renderable."""
    return draw(frame(snapshot, previous))


def draw(f: dict) -> RenderableType:
    """Draw a frame model."""
    peers = f["router"]["peers"]
    counts = ", ".join(f"{state} {n}" for state, n in sorted(f["job_counts"].items())) or "none"
    header = Text.from_markup(
        f"[bold]batchbus top[/]  router {f['router']['endpoint']}  "
        f"{peers.get('provider', 0)} provider(s), {peers.get('trainer', 0)} trainer(s), "
        f"{peers.get('admin', 0)} admin(s)  jobs: {counts}  {time.strftime('%H:%M:%S', time.localtime(f['at']))}"
    )
    providers = Table(
        "provider",
        "datasets",
        "samples served",
        "samples/s",
        "batches",
        "MiB",
        "sessions",
        "evals",
        "refused",
        box=box.SIMPLE_HEAD,
    )
    for p in f["providers"]:
        refused = ", ".join(f"{k} {v}" for k, v in p["refused"].items()) or "0"
        providers.add_row(
            p["name"],
            ", ".join(p["datasets"]) or "-",
            str(p["samples"]),
            _num(p["samples_per_s"], ".0f"),
            str(p["batches"]),
            f"{p['bytes'] / 2**20:.1f}",
            str(p["sessions"] or 0),
            str(p["evaluations"]) + (" (1 running)" if p["evaluations_running"] else ""),
            refused,
        )
    trainers = Table(
        "trainer",
        "job",
        "state",
        "epoch",
        "step",
        "loss",
        "samples",
        "samples/s",
        "data wait",
        "transport",
        box=box.SIMPLE_HEAD,
    )
    for t in f["trainers"]:
        state = {JobState.PAUSED: "[yellow]paused[/]", JobState.RUNNING: "[green]running[/]"}.get(
            t["state"], "[dim]idle[/]"
        )
        trainers.add_row(
            t["name"],
            t["job"] or "-",
            state,
            _epoch_cell(t["epoch"], t["epochs"]),
            _num(t["step"], "d"),
            _num(t["loss"], ".4f"),
            _num(t["samples"], "d"),
            _num(t["samples_per_s"], ".0f"),
            data_wait_cell(t),
            t["transport"] or "-",
        )
    jobs = Table(
        "job", "state", "trainer", "dataset", "model", "epoch", "progress", "step", "loss", box=box.SIMPLE_HEAD
    )
    for j in f["jobs"]:
        bar = Table.grid(padding=(0, 1))
        bar.add_row(ProgressBar(total=1.0, completed=j["fraction"], width=20), f"{100 * j['fraction']:3.0f}%")
        jobs.add_row(
            j["id"],
            j["state"],
            j["trainer"] or "-",
            j["dataset"],
            j["model"],
            _epoch_cell(j["epoch"], j["epochs"]),
            bar,
            f"{j['step']}/{j['total_steps'] or '?'}",
            _num(j["loss"], ".4f"),
        )
    for q in f["queued"]:
        jobs.add_row(q["id"], "[dim]queued[/]", "-", q["dataset"], q["model"], "-", "-", "-", "-")
    parts: list[RenderableType] = [
        header,
        Panel(providers, title="providers", expand=False),
        Panel(trainers, title="trainers", expand=False),
        Panel(jobs, title="jobs", expand=False),
    ]
    parts += stage_tables({name: {"pipelines": p} for name, p in f["pipelines"].items()})
    return Group(*parts)


def top_command(settings: Settings, *, interval: float, once: bool, json: bool, console: Console | None = None) -> None:
    """Draw frames every ``interval`` seconds until Ctrl-C; with ``once``, one frame (two snapshots
    ``interval`` apart, so that rates are real) and return. A router that does not answer at the
    start is an error (one line, from ``guard``); one that stops answering later is shown in the
    frame while top keeps asking."""
    console = console or SafeConsole()  # peers' strings without control characters
    with admin_client(settings) as client:
        client.hello()  # a router that is down is one line within seconds (guard), not a frame
        previous = collect(client)
        if once:
            time.sleep(interval)
            snapshot = collect(client)
            print_json(frame(snapshot, previous)) if json else console.print(render(snapshot, previous))
            return
        try:
            with Live(render(previous), console=console, auto_refresh=False, screen=False) as live:
                while True:
                    time.sleep(interval)
                    try:
                        snapshot = collect(client)
                    except BusError as err:  # the router restarting: keep the last frame, say so, retry
                        live.update(
                            Group(render(previous), Text(printable(f"router not answering: {err}"), style="red")),
                            refresh=True,
                        )
                        continue
                    live.update(render(snapshot, previous), refresh=True)
                    previous = snapshot
        except KeyboardInterrupt:
            return  # Ctrl-C is how top ends
