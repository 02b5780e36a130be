"""Following a job: a progress bar per epoch, validation accuracy as epochs end, the result at the end."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from libbus.connect.client import Client
from libbus.jobs.spec import TERMINAL_STATES
from libbus.jobs.state import JobState
from services import views

if TYPE_CHECKING:
    from services.router.store import JobView

from .output import SafeConsole
from .tables import epoch_index, epoch_line, epoch_of, result_lines

__all__ = ["watch_job"]

POLL_S = 0.5


def watch_job(client: Client, job: str, console: Console | None = None, timeout_s: float | None = None) -> JobView:
    """Poll ``job`` until it ends, drawing progress; returns the final job record."""
    console = console or SafeConsole()  # peers' strings without control characters
    shown_epochs = 0
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    columns = (
        TextColumn("[bold]epoch {task.fields[epoch]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("step {task.fields[step]}"),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[rate]} samples/s"),
        TextColumn("data wait {task.fields[wait]}%"),
        TextColumn("{task.fields[state]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as bars:
        bar: TaskID | None = None  # the bar drawn last
        bar_epoch = -1  # the (0-based) epoch it shows

        def close(history: list[dict], rate: float | None) -> None:
            """Fill the current bar with its epoch's final figures."""
            if bar is None:  # none drawn yet
                return
            total = next(t.total for t in bars.tasks if t.id == bar) or 0.0
            done: dict[str, Any] = {"completed": total, "step": int(total * (bar_epoch + 1))}
            if rate is not None:
                done["rate"] = f"{rate:.0f}"
            if bar_epoch < len(history) and isinstance(history[bar_epoch].get("train_loss"), (int, float)):
                done["loss"] = f"{history[bar_epoch]['train_loss']:.4f}"
            bars.update(bar, **done)

        while True:
            info, _ = views.job(client, job)
            p = info.get("progress") or {}
            history = p.get("history", [])
            if p and JobState(info["state"]).holding:
                # after the last epoch (validation, provider-side test) the last bar stays full; a job that
                # says no total (an entrypoint without an epochs param) shows none (tables.epoch_index)
                current = epoch_index(p) or 0
                # a function that opened no train loader reports no steps per epoch: a bar of its steps
                per_epoch = p.get("steps_per_epoch") or max(1, p["step"])
                within = p["step"] - current * per_epoch
                fields = dict(
                    epoch=epoch_of(p),
                    step=p["step"],
                    loss=f"{p['loss']:.4f}" if p.get("loss") is not None else "-",
                    rate=f"{p.get('samples_per_s', 0):.0f}",
                    wait=f"{p.get('data_wait_pct', 0):.0f}",
                    state="[yellow]paused[/]" if info["state"] == JobState.PAUSED else "",
                )
                if bar is None or current != bar_epoch:
                    if bar is not None:
                        close(history, p.get("samples_per_s"))
                    bar, bar_epoch = bars.add_task("", total=per_epoch, **fields), current
                bars.update(bar, completed=max(0, min(within, per_epoch)), **fields)
            for h in history[shown_epochs:]:
                bars.console.print(epoch_line(h, sep="  "))
            shown_epochs = max(shown_epochs, len(history))
            if info["state"] in TERMINAL_STATES:
                if bar is not None and info["state"] == JobState.SUCCEEDED:
                    close(history, (info.get("result") or {}).get("samples_per_s"))
                break
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
    result = info.get("result") or {}
    if info["state"] == JobState.SUCCEEDED:
        lines = result_lines(result)  # only the scores it has: an evaluation task on test has no val score
        console.print(f"job {job} succeeded" + (f": {lines[0]}" if lines else ""))
        for line in lines[1:]:
            console.print("  " + line)
    else:
        console.print(f"job {job} {info['state']}" + (f": {info['error']}" if info.get("error") else ""))
    return info
