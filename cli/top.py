"""``busctl top``: a live terminal view of providers, trainers, jobs and pipeline stages.

Each refresh takes a *snapshot* from the router (``Stats``, ``ListPeers``, ``ListJobs``: what
``busctl queues``, ``peers`` and ``jobs`` show) and turns it, with the snapshot before it, into a
*frame model* (:func:`frame`): plain data, printed by ``--once --json``. Rates (a provider's
samples/s) come from the difference of two successive snapshots. :func:`render` draws a frame with
rich; it is pure, so a test reads what a terminal would show without one.
"""

from __future__ import annotations

import time

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from libbus.config import Settings
from libbus.errors import BusError
from libbus.jobs.state import JobState
from services.views import Frame, Snapshot, TrainerLine, frame
from services.views import snapshot as collect

from .connection import admin_client
from .output import SafeConsole, print_json, printable
from .tables import stage_tables, wait_split

__all__ = ["collect", "data_wait_cell", "frame", "render", "top_command"]


def _epoch_cell(epoch: int | None, epochs: int | None) -> str:
    """``N/M``, ``N`` where the job names no total (an entrypoint without an epochs param); ``-`` for N not begun."""
    shown = "-" if epoch is None else str(epoch)
    return f"{shown}/{epochs}" if epochs else shown


def data_wait_cell(t: TrainerLine) -> str:
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


def render(snapshot: Snapshot, previous: Snapshot | None = None) -> RenderableType:
    """The frame of ``snapshot`` (rates against ``previous``), as a rich renderable."""
    return draw(frame(snapshot, previous))


def draw(f: Frame) -> RenderableType:
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
    shown: dict[str, str] = {JobState.PAUSED: "[yellow]paused[/]", JobState.RUNNING: "[green]running[/]"}
    for t in f["trainers"]:
        state = shown.get(t["state"], "[dim]idle[/]")
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
    jobs = Table("job", "state", "trainer", "dataset", "runs", "epoch", "progress", "step", "loss", box=box.SIMPLE_HEAD)
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
