"""Admin replies that fit: a client drops a header over ``MAX_HEADER_BYTES`` (1 MiB) as malformed, so
a reply that would be larger is cut here, with a note saying what was left out and how to see it —
never dropped silently. (What peers send to be stored is bounded at the door too: libbus/wire/schema.py
``check_stored``; this is the second line, for many rows each within bounds.)"""

from __future__ import annotations

from typing import Any

import orjson

from libbus.constants import MAX_HEADER_BYTES, KiB

from .store import JobView

__all__ = ["REPLY_BUDGET", "fit_list", "fit_job", "fit_rows"]

#: Bytes of rows or history one reply may carry; the rest of the header stays well inside the limit.
REPLY_BUDGET = MAX_HEADER_BYTES - 64 * KiB


def _size(value) -> int:
    return len(orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY))


def fit_list(rows: list, budget: int = REPLY_BUDGET) -> tuple[list, str]:
    """The leading ``rows`` that fit in ``budget`` bytes, and a note when some were left out."""
    used, kept = 0, []
    for row in rows:
        used += _size(row) + 1
        if used > budget:
            break
        kept.append(row)
    if len(kept) == len(rows):
        return rows, ""
    return kept, (
        f"{len(rows) - len(kept)} of {len(rows)} jobs left out to fit one reply "
        f"({MAX_HEADER_BYTES >> 10} KiB): ask for fewer (--limit) or one state at a time"
    )


def fit_job(job: JobView, budget: int = REPLY_BUDGET) -> tuple[JobView, str]:
    """``job`` cut to ``budget`` bytes: oldest progress reports first, then oldest events; a note
    says what was cut."""
    if _size(job) <= budget:
        return job, ""
    job = job.copy()  # the lists cut are new ones: the caller's record is left whole
    cut = []
    reports = job.get("progress_history", [])
    before = len(reports)
    while reports and _size(job) > budget:
        reports = reports[len(reports) // 2 + 1 :]
        job["progress_history"] = reports
    if len(reports) < before:
        cut.append(f"{before - len(reports)} oldest of {before} progress history")
    if _size(job) > budget:
        events = job["events"]
        before = len(events)
        while events and _size(job) > budget:
            events = events[1:]
            job["events"] = events
        if len(events) < before:
            cut.append(f"{before - len(events)} oldest of {before} events")
    if _size(job) > budget:
        cut.append("the stored result (too large for one reply)")
        job["result"] = {"truncated": True}
    return job, "cut to fit one reply: " + ", ".join(cut)


def fit_rows(rows: dict[str, dict[str, Any]], budget: int = REPLY_BUDGET) -> dict[str, dict[str, Any]]:
    """``rows`` (``Stats``: one per service, each within the stored-JSON bound) within ``budget``
    bytes: the first rows whole while three quarters of it last; each one after that only as
    ``{role, name, session, cut}`` (so ``busctl queues`` still lists it and says why it shows
    nothing); once the budget is spent, one ``…`` row counts the services left out."""
    used, left = 0, 0
    out: dict[str, dict[str, Any]] = {}
    for key, row in rows.items():
        size = _size(row) + _size(key) + 2
        if used + size > budget * 3 // 4:
            row = {k: row[k] for k in ("role", "name", "session") if k in row} | {
                "cut": f"{size} bytes of stats left out to fit one reply"
            }
            size = _size(row) + _size(key) + 2
        if used + size > budget - 1024:
            left += 1
            continue
        used += size
        out[key] = row
    if left:
        out["…"] = {"role": "-", "cut": f"{left} more services left out to fit one reply (busctl peers lists them)"}
    return out
