"""Human-readable output of busctl's read commands (rich tables), through a :class:`~cli.output.SafeConsole`:
every string a peer wrote (job names, errors, events, peer and stage names) is printed without its
control characters."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rich.table import Table

from libbus.jobs.spec import BUILTIN_PARAMS
from libbus.jobs.state import JobState
from libbus.order.epochs import Cursor
from services.views import StatsRow, epoch_index, refusals, runs

if TYPE_CHECKING:
    from services.router.peers import PeerRow
    from services.router.store import JobRow, JobView

from . import scores
from .output import SafeConsole

__all__ = [
    "epoch_index",
    "epoch_of",
    "fmt_result",
    "job",
    "jobs",
    "peers",
    "queues",
    "refusals",
    "result_lines",
    "runs",
    "segments",
    "settings",
    "stage_tables",
    "stages",
    "wait_split",
]

console = SafeConsole()


def _ago(ts: float | None) -> str:
    if not ts:
        return "-"
    s = max(0, time.time() - ts)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.0f}h ago"


def _pct(v) -> str:
    return f"{v:.4f}" if isinstance(v, (int, float)) else "-"


def fmt_result(result: dict | None) -> str:
    """A result in a table cell: its accuracies (a test one with its noise's margin), ``-`` for none."""
    if not result:
        return "-"
    parts = []
    if isinstance(result.get("val_accuracy"), (int, float)):
        parts.append(f"val acc {result['val_accuracy']:.4f}")
    if isinstance(result.get("test_accuracy"), (int, float)):
        parts.append(f"test acc {scores.score(result, 'accuracy', short=True)}")
    return ", ".join(parts) or "-"


def result_lines(r: dict) -> list[str]:
    """What a result holds, each score once and only those there are (an evaluation task on ``test``
    has no validation score); test scores with their noise's margin and, where noised, how to get
    exact ones."""
    parts = []
    val = [f"{k} {r[f'val_{k}']:.4f}" for k in ("accuracy", "loss") if isinstance(r.get(f"val_{k}"), (int, float))]
    if val:
        n = f" on {r['val_n']} samples" if isinstance(r.get("val_n"), int) else ""
        parts.append("val " + ", ".join(val) + n)
    if isinstance(r.get("test_accuracy"), (int, float)) or isinstance(r.get("test_loss"), (int, float)):
        extra = "".join(f", {k} {scores.score(r, k)}" for k in (r.get("test_metrics") or {}))
        by = f" (provider {r['test_provider']})" if r.get("test_provider") else ""
        parts.append(
            f"test accuracy {scores.score(r, 'accuracy')}, loss {scores.score(r, 'loss')}{extra} "
            f"on {r.get('test_n', '?')} private samples{by}"
        )
    if isinstance(r.get("samples_per_s"), (int, float)) and r["samples_per_s"] > 0:
        parts.append(f"{r['samples_per_s']:.0f} samples/s")
    lines = ["; ".join(parts)] if parts else []
    if isinstance(r.get("test_unrecorded"), str):  # the router's: a score of weights it does not keep
        lines.append("test score not recorded: " + "".join(c if c.isprintable() else "?" for c in r["test_unrecorded"]))
    if scores.noise_note(r):
        lines.append(scores.noise_note(r))
    return lines


def epoch_of(p: dict, succeeded: bool = False, ended: bool = False) -> str:
    """A progress report's epoch counted from 1, as ``busctl job watch`` draws it (:func:`epoch_index`; a job
    that ``ended`` at an epoch's end shows that epoch): ``N/M`` where the job says how many it trains, ``N``
    where it does not (no total is made up)."""
    index, epochs = epoch_index(p, succeeded, ended), p.get("epochs")
    known = isinstance(epochs, int) and not isinstance(epochs, bool) and epochs > 0
    shown = "?" if index is None else str(index + 1)
    return f"{shown}/{epochs}" if known else shown


def _loss(p: dict) -> str:
    """A progress report's running train loss; ``-`` where there is none (no step metered yet, or the
    job over: the loss is of the steps since the attempt started, not a score)."""
    return f"{p['loss']:.4f}" if isinstance(p.get("loss"), (int, float)) else "-"


def shown_spec(spec: dict) -> dict:
    """The fields of ``spec`` that mean something to the job: an entrypoint job's built-in loop fields
    (at their defaults) do not; an evaluation task uses only what names the model and what it scores."""
    if spec.get("task") == "evaluate":
        keep = ["task", "dataset", "split", "model_from"]
        if spec.get("evaluator"):
            keep += ["evaluator", "evaluator_kwargs"]
        else:
            keep += ["model", "model_kwargs"] + (["batch_size"] if spec.get("split") == "val" else [])
        keep += ["priority", "name"]
        return {k: spec[k] for k in keep if spec.get(k) not in ("", {}, None)}
    # an entrypoint job's spec holds the built-in loop's fields at their defaults: they mean nothing to it
    unused = {k for k in BUILTIN_PARAMS if k != "model_from"} if spec.get("entrypoint") else set()
    return {k: v for k, v in spec.items() if v not in ("", {}, None) and k not in unused}


def wait_split(split: Mapping[str, Any] | None, parts: int = 5) -> str:
    """A loader's stall split (``data_wait_split``, :meth:`libbus.loader.stall.StallMeter.breakdown`) as
    its ``parts`` largest shares, e.g. ``stage:augment 72%, read 10%, transfer 8%``; "" when none."""
    shares = (split or {}).get("parts") or {}
    total = sum(v for v in shares.values() if isinstance(v, (int, float)))
    if total <= 0:
        return ""
    top = sorted(((k, v) for k, v in shares.items() if isinstance(v, (int, float))), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in top[:parts])


def jobs(rows: list[JobRow]) -> None:
    table = Table("job", "state", "dataset", "runs", "trainer", "progress", "result", "updated")
    for r in rows:
        p = r.get("progress") or {}
        state = JobState(r["state"])
        progress = f"epoch {epoch_of(p, state is JobState.SUCCEEDED, state.terminal)}" if p else "-"
        table.add_row(
            r["id"],
            r["state"],
            r["spec"]["dataset"],
            runs(r["spec"]),
            _trainers(r),
            progress,
            fmt_result(r.get("result")),
            _ago(r["updated"]),
        )
    console.print(table)


def _trainers(job: JobRow) -> str:
    """The job's trainer; for a gang (world_size > 1) rank 0 and how many more."""
    gang = job.get("gang")
    members = gang["members"] if gang else []
    return f"{members[0]} +{len(members) - 1}" if members else job.get("trainer") or "-"


#: How an epoch record's usual metrics are shown; any other a job reports is shown by its own name.
_LABELS = {"train_loss": "train loss", "val_loss": "val loss", "val_accuracy": "val accuracy"}


def epoch_line(record: dict, sep: str = " ") -> str:
    """``epoch N: train loss L val loss V val accuracy A``: every number of an epoch's record, in its
    order (an entrypoint job reports the metrics it chooses, by its own names, or none)."""
    parts = [
        f"{_LABELS.get(k, k)} {v:.4f}"
        for k, v in record.items()
        if k != "epoch" and isinstance(v, (int, float)) and not isinstance(v, bool)
    ]
    return f"epoch {record.get('epoch', '?')}: " + (sep.join(parts) or "(no metrics)")


def job(info: JobView) -> None:
    console.print(
        f"[bold]{info['id']}[/] {info['state']}  trainer {info.get('trainer') or '-'}  attempts {info['attempts']}"
    )
    gang = info.get("gang")
    if gang and JobState(info["state"]).holding:
        ranks = ", ".join(f"{rank}: {name}" for rank, name in enumerate(gang["members"]))
        console.print(f"gang: rank {ranks}; rendezvous {gang['rendezvous'] or '(rank 0 not there yet)'}")
    console.print("spec: " + ", ".join(f"{k}={v}" for k, v in shown_spec(info["spec"]).items()))
    p = info.get("progress") or {}
    if p:
        console.print(
            f"progress: epoch {epoch_of(p, info['state'] == JobState.SUCCEEDED, JobState(info['state']).terminal)} step {p.get('step')} "
            f"loss {_loss(p)} {p.get('samples_per_s', 0):.0f} samples/s "
            f"data wait {p.get('data_wait_pct', 0):.1f}%"
        )
        split = p.get("data_wait_split") or {}
        if wait_split(split):  # where the waiting went: the part to fix first leads
            slowest = split.get("slowest") or p.get("data_wait_slowest")
            console.print(f"data wait split: {wait_split(split)}" + (f"; slowest replica {slowest}" if slowest else ""))
        for h in p.get("history", []):
            console.print("  " + epoch_line(h))
    r = info.get("result") or {}
    lines = result_lines(r)
    if lines:
        console.print("result: " + lines[0])
        for line in lines[1:]:
            console.print("  " + line)
    if r.get("model_sha256"):  # an evaluation task: the weights it scored
        console.print(f"scored weights: sha256 {r['model_sha256']}")
    if r.get("model"):
        console.print(f"model: {r['model']['path']} sha256 {r['model']['sha256']}")
        if r["model"].get("weights_digest"):  # the tensors alone: equal for equal weights, whatever the file says
            console.print(f"  weights digest {r['model']['weights_digest']} (equal for equal tensors)")
    if info.get("error"):
        console.print(f"[red]error:[/] {info['error']}")
    ckpts = info.get("checkpoints") or []
    if ckpts:
        last = ckpts[-1]
        console.print(
            f"checkpoints: {len(ckpts)}, last at step {last['step']} ({Cursor.of_checkpoint(last).shown()}) "
            f"on {last.get('trainer', '-')}: {last['path']}"
        )
    for p in info.get("progress_history", []):
        console.print(
            f"  {time.strftime('%H:%M:%S', time.localtime(p['at']))} {p.get('state', JobState.RUNNING):<8} "
            f"epoch {epoch_of(p)} step {p.get('step')} loss {_loss(p)} "
            f"{p.get('samples_per_s', 0):.0f} samples/s data wait {p.get('data_wait_pct', 0):.0f}%"
        )
    shown, total = info.get("events", []), info.get("events_total", 0)
    if total > len(shown):
        console.print(f"events: the {len(shown)} shown of {total} kept (older ones: --offset)")
    for e in shown:
        console.print(f"  {time.strftime('%H:%M:%S', time.localtime(e['at']))} {e['state']:<9} {e['reason']}")


def peers(rows: list[PeerRow]) -> None:
    # "subject" is who the peer is (its token's sub); "name" only what it calls itself
    table = Table("name", "subject", "role", "endpoint", "datasets", "pid", "since")
    for r in sorted(rows, key=lambda r: (r["role"], r["name"])):
        table.add_row(
            r["name"],
            r.get("subject", "-"),
            r["role"],
            r.get("endpoint", "-"),
            ", ".join(r.get("datasets", [])) or "-",
            str(r.get("pid", "-")),
            _ago(r.get("since")),
        )
    console.print(table)


def queues(services: dict[str, StatsRow]) -> None:
    table = Table("service", "role", "sessions", "received", "sent", "refused", "detail")
    for name, s in sorted(services.items()):
        counters = s.get("counters", {})
        refused = ", ".join(f"{k} {v}" for k, v in refusals(counters).items()) or "0"
        detail = {
            k: v
            for k, v in s.items()
            if k not in ("counters", "name", "endpoint", "role", "sessions", "pipelines", "session")
        }
        table.add_row(
            name,
            s.get("role", "-"),
            str(s.get("sessions", "-")),
            str(counters.get("received", "-")),
            str(counters.get("sent", "-")),
            refused,
            str(detail) if detail else "-",
        )
    console.print(table)
    stages(services)


def revoked(rows: list[dict]) -> None:
    table = Table("jti", "revoked", "refused until", "reason")
    for r in rows:
        table.add_row(
            r["jti"],
            _ago(r.get("at")),
            time.strftime("%Y-%m-%d %H:%M", time.localtime(r["exp"])),
            r.get("reason") or "-",
        )
    console.print(table)


def stages(services: Mapping[str, StatsRow]) -> None:
    """Print :func:`stage_tables`."""
    for table in stage_tables(services):
        console.print(table)


def stage_tables(services: Mapping[str, StatsRow]) -> list[Table]:
    """One table per pipeline dataset of each provider: a row per stage, its output queue beside it
    (size/capacity, then put/get/drop counts); the row ``(requests)`` is the pipeline's input queue."""
    tables = []
    for name, s in sorted(services.items()):
        for dataset, p in sorted((s.get("pipelines") or {}).items()):
            table = Table(title=f"{name}: pipeline {dataset}")
            rows = p.get("stages", [])
            # names and types are never cut short, even on an 80-column terminal: the numbers fold instead
            table.add_column("stage", min_width=max([len("(requests)")] + [len(str(r.get("name"))) for r in rows]))
            table.add_column("type", min_width=max([5] + [len(str(r.get("type"))) for r in rows]))
            for column in ("in", "out", "err", "busy s", "queue", "put/get/drop"):
                table.add_column(column, justify="right", overflow="fold")
            table.add_row("(requests)", "queue", "-", "-", "-", "-", *_queue_cells(p.get("requests", {})))
            for st in rows:
                table.add_row(
                    st.get("name", "?"),
                    st.get("type", "?"),
                    str(st.get("items_in", "-")),
                    str(st.get("items_out", "-")),
                    str(st.get("errors", "-")),
                    f"{st.get('busy_s', 0):.2f}",
                    *_queue_cells(st.get("queue", {})),
                )
            tables.append(table)
    return tables


def _queue_cells(q: Mapping[str, Any]) -> tuple[str, str]:
    return (
        f"{q.get('size', '-')}/{q.get('capacity', '-')}",
        f"{q.get('put', '-')}/{q.get('get', '-')}/{q.get('drop', '-')}",
    )


def settings(values: dict, sources: dict) -> None:
    table = Table("setting", "value", "from")
    for k, v in values.items():
        table.add_row(k, "***" if k == "token" and v else str(v), sources.get(k, "default"))
    console.print(table)


def segments(rows: list[dict]) -> None:
    if not rows:
        console.print("no batchbus rings in /dev/shm")
        return
    table = Table("ring", "owner pid", "owner", "slots", "slot size", "size", "age")
    for r in rows:
        table.add_row(
            r["name"],
            str(r["pid"]),
            "running" if r["alive"] else "[red]gone[/red] (busctl shm gc)",
            str(r["slots"]),
            f"{r['slot_bytes'] / 2**20:.1f} MiB",
            f"{r['size'] / 2**20:.1f} MiB",
            f"{r['age_s']:.0f}s",
        )
    console.print(table)
