"""What an administrator's read requests show, as plain data: one code path for ``busctl``'s ``--json``
output and ``busctl web``'s JSON endpoints, so the two never disagree.

Each function takes a connected :class:`~libbus.connect.client.Client` (an admin session: the router
cuts every answer to the token's scopes) and returns dicts and lists of JSON values. Nothing here
prints or formats for a terminal; ``cli/`` draws tables from these, ``services/web`` serves them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict, cast

from libbus.connect.client import Client
from libbus.jobs.state import JobState
from libbus.wire.messages import GetJob, GetJobLogs, GetStudy, ListJobs, ListPeers, ListStudies, Resolve, Stats

if TYPE_CHECKING:  # the records' modules import numpy and zmq's services; busctl imports this one
    from libbus.loader.stall import StallBreakdown
    from libbus.serve.backlog import BacklogStats
    from libbus.wire.dataset_info import ProviderEntry
    from services.provider.destination import DatasetServed
    from services.provider.sources.pipeline.decode_cache.store import DecodeCacheStats
    from services.provider.sources.pipeline_metrics import PipelineMetrics
    from services.provider.sources.storage.blockmemory import ReadStats
    from services.provider.sources.storage.objects import ObjectStoreStats
    from services.router.peers import PeerRow
    from services.router.store import JobRow, JobView
    from services.router.studies import StudySummary, StudyView

__all__ = [
    "ACTIVE_STATES",
    "QUEUED_SHOWN",
    "DatasetCache",
    "DatasetProvider",
    "DatasetRow",
    "Frame",
    "JobLine",
    "JobLogsView",
    "ProviderLine",
    "QueuedLine",
    "RouterLine",
    "Snapshot",
    "StatsRow",
    "TrainerLine",
    "datasets",
    "epoch_index",
    "epoch_records",
    "frame",
    "job",
    "job_logs",
    "job_metrics",
    "jobs",
    "peers",
    "refusals",
    "runs",
    "snapshot",
    "stats",
    "studies",
    "study",
    "test_scores",
]

#: Jobs that hold a trainer (``busctl top`` lists them with a progress bar).
ACTIVE_STATES = (JobState.RUNNING, JobState.PAUSED)
#: Queued jobs a snapshot lists (the rest are counted).
QUEUED_SHOWN = 5


class StatsRow(TypedDict, total=False):
    """A service's row of ``Stats`` (``busctl queues --json``) as its readers take it: the router's ``role``,
    ``name`` and ``session``, then what the service put on its heartbeat (the router's ``RouterRow``, a
    provider's ``ProviderRow``, a trainer's ``TrainerStats``). Every key may be missing: the row is what
    that peer sent, of its version, and a heartbeat whose stats broke the bounds leaves only ``refused``,
    saying why (a string, where a provider's ``refused`` counts refusals by cause)."""

    role: str
    name: str
    session: str
    # every server's (libbus.serve.server.ServerStats)
    endpoint: str
    sessions: int
    pending: int
    counters: dict[str, int]
    backlog: BacklogStats
    # the router's (services.router.handler.RouterStats)
    jobs: dict[str, int]
    peers: dict[str, int]
    refused_transitions: dict[str, int]
    # a provider's (services.provider.metrics.ProviderStats)
    datasets: dict[str, DatasetServed]
    waiting_assignment: int
    refused: dict[str, int] | str
    evaluations_running: int
    remote_reads: dict[str, ReadStats]
    evaluations_queued: int
    pipelines: dict[str, PipelineMetrics]
    decode_cache: DecodeCacheStats
    object_store: ObjectStoreStats
    connected: bool
    # a trainer's (services.trainer.service.metrics.TrainerStats)
    job: str | None
    tasks: dict[str, int]
    data_wait_s: float
    data_wait_parts: dict[str, float]


class JobLogsView(TypedDict):
    """Output lines of one attempt of a job (:func:`job_logs`)."""

    type: str
    job: str
    #: The attempt the lines are of.
    attempt: int
    lines: list[str]
    #: The ``after`` of the lines that follow.
    next: int
    #: Lines of this attempt no longer kept.
    dropped: int
    #: The job's attempts that have lines.
    attempts: list[int]


class Snapshot(TypedDict):
    """What :func:`snapshot` took: every service's ``Stats`` row, the peers, the active and first queued jobs."""

    at: float
    #: The router's endpoint.
    endpoint: str
    services: dict[str, StatsRow]
    peers: list[PeerRow]
    jobs: list[dict[str, Any]]


class RouterLine(TypedDict):
    endpoint: str | None
    #: Sessions open by kind.
    peers: dict[str, int]
    sessions: int | None


class ProviderLine(TypedDict):
    """A provider in :func:`frame`: its totals over its datasets and its samples/s since the last snapshot."""

    name: str
    endpoint: str | None
    datasets: list[str]
    samples: int
    batches: int
    bytes: int
    evaluations: int
    #: None without a previous snapshot (or after a restart).
    samples_per_s: float | None
    sessions: int | None
    #: Refusals by cause: each error code it answered with, malformed messages, its own refusals.
    refused: dict[str, int]
    evaluations_running: int


class TrainerLine(TypedDict):
    """A trainer in :func:`frame`: the job it holds (``state`` ``idle`` without one) and its last progress."""

    name: str
    job: str | None
    state: str
    #: The 1-based epoch being trained.
    epoch: int | None
    epochs: int | None
    step: int | None
    loss: float | None
    samples: int | None
    samples_per_s: float | None
    data_wait_pct: float | None
    data_wait_slowest: str | None
    data_wait_split: StallBreakdown | None
    transport: str | None
    #: Jobs it ran to an end, by final state.
    tasks: dict[str, int]


class JobLine(TypedDict):
    """An active job in :func:`frame`, with its progress as a fraction of its steps."""

    id: str
    state: str
    trainer: str | None
    dataset: str
    #: What it runs (:func:`runs`).
    model: str
    epoch: int | None
    epochs: int | None
    step: int
    total_steps: int | None
    loss: float | None
    fraction: float


class QueuedLine(TypedDict):
    id: str
    dataset: str
    model: str
    priority: int


class DatasetProvider(TypedDict):
    """A provider of a dataset as ``ListPeers`` names it, when ``Resolve`` lists none (:func:`datasets`)."""

    name: str
    endpoint: str
    host_id: str


class DatasetCache(TypedDict):
    """A provider's decode cache as :func:`datasets` shows it for one dataset: the dataset's share (its
    ``DecodeCacheDataset``) and the whole cache's size and limit."""

    hits: int
    misses: int
    hit_rate: float
    entries: int
    bytes: int
    final_hits: int
    final_misses: int
    final_hit_rate: float
    cache_bytes: int
    limit_bytes: int


class DatasetRow(TypedDict):
    """A dataset as ``busctl datasets --json`` prints it (:func:`datasets`): its providers, the DatasetInfo
    the router holds for it (a peer's JSON: each value is checked where it is read), the private test split's
    evaluations left today (None: unlimited) and, per provider, its decode cache's share of it."""

    dataset: str
    providers: list[ProviderEntry] | list[DatasetProvider]
    info: dict[str, Any]
    evaluations_left_today: int | None
    decode_cache: NotRequired[dict[str, DatasetCache]]


class Frame(TypedDict):
    """The frame model of ``busctl top`` and the web's cluster page (``busctl top --once --json``)."""

    at: float
    router: RouterLine
    #: Jobs by state.
    job_counts: dict[str, int]
    providers: list[ProviderLine]
    trainers: list[TrainerLine]
    jobs: list[JobLine]
    queued: list[QueuedLine]
    #: Service name → its pipelines' metrics by dataset.
    pipelines: dict[str, dict[str, PipelineMetrics]]


# -- jobs ------------------------------------------------------------------------------------------


def jobs(client: Client, state: str | None = None, limit: int = 50, offset: int = 0) -> tuple[list[JobRow], str]:
    """Jobs newest first, ``limit`` after the ``offset`` newest (``busctl jobs --json``), and the router's
    note when it cut the list to fit one reply ("" otherwise)."""
    reply = client.request(ListJobs(state=state, limit=limit, offset=offset))
    return cast("list[JobRow]", reply.jobs), reply.note  # the router's rows (JobStore.list)


def job(client: Client, job_id: str, progress: int = 0, events: int = 200, offset: int = 0) -> tuple[JobView, str]:
    """One job's record (``busctl job show --json``): with ``progress`` > 0 its last progress reports
    (``progress_history``), its newest ``events`` events after ``offset``; and the router's note."""
    reply = client.request(GetJob(job=job_id, progress=max(0, progress), events=events, offset=offset))
    return cast("JobView", reply.job), reply.note  # as the router's on_GetJob made it


def job_logs(client: Client, job_id: str, attempt: int = -1, after: int = 0) -> JobLogsView:
    """Output lines of one attempt from line ``after`` on (``busctl job logs --json``): ``lines``, ``next``
    (the ``after`` of the lines that follow), ``dropped``, ``attempt``, ``attempts``."""
    reply = client.request(GetJobLogs(job=job_id, attempt=attempt, after=after)).header()
    reply.pop("id", None)  # the request's number on this connection: nothing of the job's
    return cast(JobLogsView, reply)  # the JobLogs message's fields, checked as it was decoded


def epoch_records(info: JobRow) -> list[dict]:
    """The job's epoch records: its latest progress report's history, or its result's once it ended."""
    for holder in (info.get("progress"), info.get("result")):
        history = (holder or {}).get("history")
        if isinstance(history, list) and history:
            return [r for r in history if isinstance(r, dict)]
    return []


def job_metrics(client: Client, job_id: str, reports: int = 1000) -> tuple[dict, JobView]:
    """A job's metrics (``busctl job metrics --json``): ``{job, history, reports, note}``, its epoch
    records and its newest ``reports`` progress reports; and the job's record they came with."""
    info, note = job(client, job_id, progress=reports, events=0)
    metrics = {
        "job": job_id,
        "history": epoch_records(info),
        "reports": info.get("progress_history") or [],
        "note": note,
    }
    return metrics, info


def test_scores(result: dict | None) -> dict[str, dict]:
    """A result's private-test scores with their noise's margin at 95% (``busctl job show`` prints them so):
    metric → ``{value, margin}``; ``margin`` 0 for an exact score, None where the provider did not
    report its noise."""
    r = result or {}
    metrics = ["accuracy", "loss", *(r.get("test_metrics") or {})]
    epsilon, n = r.get("test_epsilon"), r.get("test_n")
    out = {}
    for metric in metrics:
        value = r.get(f"test_{metric}", (r.get("test_metrics") or {}).get(metric))
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        margin: float | None = None
        if isinstance(epsilon, (int, float)) and isinstance(n, int):
            from services.provider.score_release import margin as noise_margin  # noqa: PLC0415 - numpy, only when shown

            margin = 0.0 if epsilon <= 0 else noise_margin(metric, n, float(epsilon))
        out[metric] = {"value": value, "margin": margin}
    return out


def epoch_index(p: dict, succeeded: bool = False, ended: bool = False) -> int | None:
    """The epoch a progress report is in, from 0 (``busctl job watch`` draws its bar): the epoch under way,
    the last one once every epoch has run. A report counts the epochs done, from 0 (``epoch``: its train
    loader's epoch, or without one the epochs it reported). Without a total (an entrypoint job that names
    no ``epochs``) an epoch is over where the report says so: its step is that epoch's last, or, for a
    job with no train loader, the job ``succeeded`` (its function returned after its last report).

    A job that ``ended`` (stopped, pruned, failed or succeeded) at an epoch's end is in no later epoch: a
    trial pruned at its first epoch's report trained 1 epoch of 3, not 2. Its end is an epoch's where its
    step is that epoch's last, or, with no train loader, where it had reported every epoch it counts."""
    epoch, epochs = p.get("epoch"), p.get("epochs")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        return None
    total = epochs if isinstance(epochs, int) and not isinstance(epochs, bool) and epochs > 0 else None
    per, step, history = p.get("steps_per_epoch"), p.get("step"), p.get("history")
    at_end = isinstance(per, int) and per > 0 and isinstance(step, int) and epoch >= 1 and step == epoch * per
    if (ended or succeeded) and epoch >= 1:
        reported_all = per is None and isinstance(history, list) and len(history) >= epoch
        if at_end or reported_all or (succeeded and per is None):
            return min(epoch, total) - 1 if total is not None else epoch - 1
    if total is not None:
        return min(epoch, total - 1)
    return max(0, epoch - 1) if at_end or (succeeded and per is None) else epoch


# -- studies ---------------------------------------------------------------------------------------


def studies(client: Client) -> list[StudySummary]:
    """Studies, newest first (``busctl studies --json``)."""
    return cast("list[StudySummary]", client.request(ListStudies()).studies)  # as the router's Studies.list made them


def study(client: Client, study_id: str) -> StudyView:
    """A study: its trials, their params, states, values and reports, and its best (``busctl study show --json``)."""
    return cast("StudyView", client.request(GetStudy(study=study_id)).study)  # as the router's Studies.show made it


# -- the cluster -----------------------------------------------------------------------------------


def peers(client: Client) -> list[PeerRow]:
    """Providers, trainers and admins connected to the router (``busctl peers --json``)."""
    return cast("list[PeerRow]", client.request(ListPeers()).peers)  # as the router's Peers made them


def stats(client: Client) -> dict[str, StatsRow]:
    """Every service's queue and traffic metrics, as carried on heartbeats (``busctl queues --json``)."""
    return client.request(Stats()).services


def datasets(client: Client) -> list[DatasetRow]:
    """Every dataset a connected provider serves (``busctl datasets --json``): ``[{dataset, providers:
    [{name, endpoint, host_id}], info, decode_cache, evaluations_left_today}]``, sorted by name.

    ``info`` is the DatasetInfo the router holds from the first provider listing the dataset (every
    provider of one name is expected to serve the same data). ``decode_cache``: per provider whose
    decode cache holds this dataset, its counters for it and the whole cache's size and limit, as of
    the provider's last heartbeat (``Stats``). ``evaluations_left_today``: scores of its private test split
    that may still be released today, for all its providers together (the router keeps the budget;
    the fewest any of its providers charges against), ``None`` when unlimited.
    """
    served: dict[str, list[DatasetProvider]] = {}
    left: dict[str, list[int]] = {}
    for peer in sorted((p for p in peers(client) if p["role"] == "provider"), key=lambda p: p["name"]):
        for name in peer.get("datasets", []):
            served.setdefault(name, []).append(
                {"name": peer["name"], "endpoint": peer.get("endpoint", ""), "host_id": peer.get("host_id", "")}
            )
            n = (peer.get("evaluations_left_today") or {}).get(name)
            left.setdefault(name, []).extend([n] if isinstance(n, int) else [])
    rows: list[DatasetRow] = []
    for name in sorted(served):
        # Resolve carries the DatasetInfo the provider registered in its Hello
        resolved = client.request(Resolve(dataset=name))
        rows.append(
            {
                "dataset": name,
                "providers": resolved.providers or served[name],
                "info": resolved.info,
                "evaluations_left_today": min(left[name]) if left[name] else None,
            }
        )
    caches = _decode_caches(stats(client))
    for row in rows:
        row["decode_cache"] = {
            provider: {
                **cache["datasets"][row["dataset"]],
                "cache_bytes": cache["bytes"],
                "limit_bytes": cache["limit_bytes"],
            }
            for provider, cache in caches.items()
            if row["dataset"] in cache.get("datasets", {})
        }
    return rows


def _decode_caches(services: dict[str, StatsRow]) -> dict[str, DecodeCacheStats]:
    """Provider name → its decode cache's stats, for the providers that run one."""
    return {
        row.get("name", key): row["decode_cache"]
        for key, row in services.items()
        if row.get("role") == "provider" and isinstance(row.get("decode_cache"), dict)
    }


def refusals(counters: Mapping[str, int]) -> dict[str, int]:
    """A service's refusals by cause: each error code it answered with, and malformed messages."""
    out = {k.removeprefix("error_"): v for k, v in counters.items() if k.startswith("error_") and v}
    if counters.get("malformed"):
        out["malformed"] = counters["malformed"]
    return dict(sorted(out.items()))


# -- a snapshot of everything, and the frame of busctl top -----------------------------------------


def snapshot(client: Client) -> Snapshot:
    """One snapshot: every service's Stats, the peers, the active and the first queued jobs."""
    taken: Snapshot = {
        "at": time.time(),
        "endpoint": client.endpoint,
        "services": client.request(Stats(), retries=0).services,
        "peers": client.request(ListPeers(), retries=0).peers,
        "jobs": [],
    }
    for state in (*ACTIVE_STATES, JobState.QUEUED):
        limit = QUEUED_SHOWN if state is JobState.QUEUED else 1000
        taken["jobs"] += client.request(ListJobs(state=state, limit=limit), retries=0).jobs
    return taken


def _rate(now: float, before: float | None, dt: float | None) -> float | None:
    """Per second between two counter readings; None without a previous one (or after a restart)."""
    if before is None or not dt or dt <= 0 or now < before:
        return None
    return (now - before) / dt


def _served(stats: StatsRow) -> dict[str, int]:
    """A provider's totals over its datasets: samples, batches, bytes, evaluations."""
    total = {"samples": 0, "batches": 0, "bytes": 0, "evaluations": 0}
    for counters in (stats.get("datasets") or {}).values():
        total["samples"] += int(counters.get("samples", 0))
        total["batches"] += int(counters.get("batches", 0))
        total["bytes"] += int(counters.get("bytes", 0))
        total["evaluations"] += int(counters.get("evaluations", 0))
    return total


def _row(services: dict[str, StatsRow], peer: PeerRow) -> StatsRow | None:
    """A peer's Stats row: its session's (the router keys rows by token subject, not by name; a
    router before that keyed them by name)."""
    row = next((r for r in services.values() if peer.get("session") and r.get("session") == peer["session"]), None)
    return row if row is not None else services.get(peer["name"])


def frame(taken: Snapshot, previous: Snapshot | None) -> Frame:
    """The frame model of a snapshot, rates against ``previous`` (``busctl top --once --json``):
    the router, job counts, providers (with samples/s), trainers, active and queued jobs, pipelines."""
    services, peer_rows = taken["services"], taken["peers"]
    before = previous["services"] if previous else {}
    dt = taken["at"] - previous["at"] if previous else None
    router = services.get("router", {})
    providers: list[ProviderLine] = []
    for peer in sorted((p for p in peer_rows if p["role"] == "provider"), key=lambda p: p["name"]):
        row: StatsRow = _row(services, peer) or {}
        served = _served(row)
        old = _row(before, peer)
        earlier = _served(old)["samples"] if old is not None else None
        refused = refusals(row.get("counters", {}))
        own = row.get("refused")
        for cause, n in (own if isinstance(own, dict) else {}).items():  # a string: its stats were refused
            refused[cause] = refused.get(cause, 0) + n
        providers.append(
            {
                "name": peer["name"],
                "endpoint": peer.get("endpoint"),
                "datasets": peer.get("datasets", []),
                "samples": served["samples"],
                "batches": served["batches"],
                "bytes": served["bytes"],
                "evaluations": served["evaluations"],
                "samples_per_s": _rate(served["samples"], earlier, dt),
                "sessions": row.get("sessions"),
                "refused": refused,
                "evaluations_running": row.get("evaluations_running", 0),
            }
        )
    active = [j for j in taken["jobs"] if j["state"] in ACTIVE_STATES]
    by_trainer = {j["trainer"]: j for j in active if j.get("trainer")}
    trainers: list[TrainerLine] = []
    for peer in sorted((p for p in peer_rows if p["role"] == "trainer"), key=lambda p: p["name"]):
        row = _row(services, peer) or {}
        held = by_trainer.get(peer["name"])
        p = (held or {}).get("progress") or {}
        trainers.append(
            {
                "name": peer["name"],
                "job": held["id"] if held else row.get("job"),
                "state": held["state"] if held else "idle",
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
                "tasks": row.get("tasks", {}),
            }
        )
    return {
        "at": taken["at"],
        "router": {
            "endpoint": taken.get("endpoint"),
            "peers": router.get("peers", {}),
            "sessions": router.get("sessions"),
        },
        "job_counts": router.get("jobs", {}),
        "providers": providers,
        "trainers": trainers,
        "jobs": [_job_row(j) for j in active],
        "queued": [
            {
                "id": j["id"],
                "dataset": j["spec"]["dataset"],
                "model": runs(j["spec"]),  # what it runs: an entrypoint's function, an evaluation, a model
                "priority": j.get("priority", 0),
            }
            for j in taken["jobs"]
            if j["state"] == JobState.QUEUED
        ],
        "pipelines": {name: s["pipelines"] for name, s in services.items() if s.get("pipelines")},
    }


def runs(spec: dict) -> str:
    """What a job runs, for a table: an entrypoint's function, an evaluation task's model source, or
    the built-in model."""
    if spec.get("entrypoint"):
        return spec["entrypoint"]
    if spec.get("task") == "evaluate":
        source = "uploaded file" if spec.get("model_from") == "upload" else spec.get("model_from", "?")
        return f"evaluate {source}" + (f" ({spec['evaluator']})" if spec.get("evaluator") else "")
    return spec.get("model", "-")


def _epoch(p: dict) -> int | None:
    """The 1-based epoch being trained (a finished last epoch stays the last; :func:`epoch_index`)."""
    index = epoch_index(p)
    return None if index is None else index + 1


def _job_row(row: dict[str, Any]) -> JobLine:
    p = row.get("progress") or {}
    total = (p.get("epochs") or 0) * (p.get("steps_per_epoch") or 0)
    return {
        "id": row["id"],
        "state": row["state"],
        "trainer": row.get("trainer"),
        "dataset": row["spec"]["dataset"],
        "model": runs(row["spec"]),  # what it runs: an entrypoint's function, an evaluation, a model
        "epoch": _epoch(p),
        # the report's total (none for an entrypoint that names none); the spec's for a built-in job not begun
        "epochs": p.get("epochs") if p else None if row["spec"].get("entrypoint") else row["spec"]["epochs"],
        "step": p.get("step", 0),
        "total_steps": total or None,
        "loss": p.get("loss"),
        "fraction": min(1.0, p.get("step", 0) / total) if total else 0.0,
    }
