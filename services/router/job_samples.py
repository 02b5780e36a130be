"""The samples of a job's steps, looked up (``busctl job samples``) and skipped (``busctl job skip``).

Both are derived, never stored: a job's order follows from its spec and the segments its checkpoints
recorded (:mod:`libbus.order.history`), so the router answers which samples made a step without any
trainer, and a skip is written as index ranges into the job's spec (its ``skip``), which every later
attempt's loaders leave out. A trainer's automatic skip of a loss spike comes here too, bounded by the
job's ``spike`` option.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from libbus.errors import BadRequest, Forbidden, Unavailable
from libbus.jobs.spec import JobSpec
from libbus.jobs.state import JobState
from libbus.order import history
from libbus.order.epochs import MAX_SKIP_RANGES
from libbus.wire.messages import GetJobSamples, JobSamples, Ok, SkipJob

from .store import JobRow, JobStore, Segment, stored_spec

__all__ = ["CHECKPOINTS_LOOKED_AT", "Skipped", "skip", "step_samples"]

#: Checkpoint records a skip looks through for the last one before its first step (the store keeps 50).
CHECKPOINTS_LOOKED_AT = 200


@dataclass(frozen=True)
class Skipped:
    """A skip written to the store: the job as it was read before it, the event's reason, the reply."""

    job: JobRow
    reason: str
    reply: Ok


def step_samples(store: JobStore, msg: GetJobSamples, split_size: Callable[[str], int | None]) -> JobSamples:
    """The sample indices of a step of ``msg.job`` (or of a range of one epoch's order), derived
    from its spec and segments. ``split_size(dataset)``: the train split's size as a live provider
    serves it (None: none online), used when no checkpoint cursor of the job records it."""
    job = store.get(msg.job, events=False)
    spec = stored_spec(job["spec"])
    segments = store.segments(msg.job)
    n = _order_size(spec, segments, split_size)
    if msg.epoch >= 0:
        indices = history.epoch_range(spec, msg.epoch, msg.start, msg.stop, n=n)
        entry = {"epoch": msg.epoch, "start": msg.start, "stop": msg.stop, "indices": indices}
        return JobSamples(job=msg.job, samples=[entry], n=n)
    if msg.step < 1:
        raise BadRequest(f"give a step (counted from 1) or an epoch and range; got step {msg.step}")
    rank = None if msg.rank < 0 else msg.rank
    seg = history.segment_of(segments, msg.step)  # a reply holds at most an epoch range's positions
    asked = int(seg.get("batch_size") or spec.batch_size) * (int(seg.get("world_size", 1)) if rank is None else 1)
    if asked > history.MAX_RANGE:
        raise BadRequest(
            f"step {msg.step} holds {asked} samples{'' if rank is None else ' on a rank'}; a reply holds at "
            f"most {history.MAX_RANGE}: ask for one rank's (--rank), or an epoch's range of its positions"
        )
    out = history.step_samples(spec, segments, msg.step, n=n, rank=rank)
    done = int((job["progress"] or {}).get("step", 0) or 0)
    note = (
        f"step {msg.step} is not trained yet (the job is at step {done}): its planned samples"
        if msg.step > done
        else ""
    )
    return JobSamples(job=msg.job, samples=out, n=n, note=note)


def skip(store: JobStore, by: str, msg: SkipJob, split_size: Callable[[str], int | None]) -> Skipped:
    """``busctl job skip``: the samples of ``msg.steps`` and ``msg.samples`` join the job's skips
    (its spec, so they survive a router restart and reach every attempt's loaders); the job
    rewinds to its last checkpoint before the first skipped step (with samples only: its last
    one), so that its next attempt resumes there without them (docs/jobs.md). The caller takes the
    job from a trainer that holds it (:class:`Skipped` gives the job as it was before)."""
    job = store.get(msg.job, events=True, limit=CHECKPOINTS_LOOKED_AT)
    state = JobState(job["state"])
    if state is JobState.SUCCEEDED:
        raise BadRequest(f"job {msg.job} already succeeded: nothing of it is left to train")
    spec = stored_spec(job["spec"])
    if spec.task != "train":
        raise BadRequest(f"job {msg.job} is an evaluation task: it trains on no samples")
    steps = _ranges(msg.steps, "steps", low=1)
    samples = _ranges(msg.samples, "samples")
    if msg.spike:
        _check_spike_skip(spec, steps, samples)
    if not steps and not samples:
        raise BadRequest("skip needs steps [[a, b], ...] (steps a..b-1) or samples [[a, b], ...] (indices a..b-1)")
    count = sum(b - a for a, b in steps)
    if count > history.MAX_SKIP_STEPS:
        raise BadRequest(f"skip names {count} steps; at most {history.MAX_SKIP_STEPS} at once")
    segments = store.segments(msg.job)
    n = _order_size(spec, segments, split_size)
    first = spec.train_range[0] if spec.train_range else 0
    for a, b in samples:
        if a < first or b > first + n:
            raise BadRequest(f"samples {a}:{b} are outside the job's {first}:{first + n} of its train split")
    ranges = history.union_ranges(_steps_ranges(spec, segments, steps, n), samples)  # by bounds: no index expanded
    if not ranges:
        raise BadRequest(f"steps {_shown_ranges(steps)} of job {msg.job} have no samples (past its last epoch)")
    held = sum(len(one) for one in spec.skip)
    if held + len(ranges) > MAX_SKIP_RANGES:
        raise BadRequest(
            f"skips would hold more than {MAX_SKIP_RANGES} index ranges in all (this skip is {len(ranges)}, "
            f"job {msg.job}'s skips hold {held}): skip fewer or longer stretches (samples a:b is one range)"
        )
    changes: dict = {"skip": [*spec.skip, ranges]}
    if msg.spike:  # a trainer's automatic skip of a loss spike: recorded, and bounded by spike.max_skips
        changes["spikes"] = [*spec.spikes, {**_spike_record(msg.spike), "steps": steps[0]}]
    new = spec.updated(**changes)
    target = job["checkpoint"]
    if steps:
        before = [c for c in job["checkpoints"] if c["step"] < steps[0][0]]
        target = before[-1] if before else None
    where = f"rewinds to the checkpoint of step {target['step']}" if target else "starts over from step 0"
    what = f"steps {_shown_ranges(steps)}" if steps else ""
    what += (" and " if what else "") + (f"samples {_shown_ranges(samples)}" if samples else "")
    skipped = sum(b - a for a, b in ranges)
    reason = f"skipped: {skipped} sample(s) of {what} never trained again, by {by}; the job {where}"
    if msg.spike:
        reason = f"{_spike_event(msg.spike, new)}; {reason}"
    store.rewind(msg.job, new, target, reason)
    reply = Ok(detail={"skipped": skipped, "ranges": len(ranges), "rewind": where, "skips": len(new.skip)})
    return Skipped(job, reason, reply)


def _check_spike_skip(spec: JobSpec, steps: list[list[int]], samples: list[list[int]]) -> None:
    """A trainer's spike skip stays inside what the job's ``spike`` option allows: the option is on,
    ``max_skips`` is not spent, and the stretch is one run of at most ``skip_before + 1`` steps ending at
    the spike, never samples. A trainer token asks this, so it is bounded here, not only in the trainer."""
    option = spec.spike
    if not option:
        raise Forbidden("this job has no spike option: a trainer may not skip its steps")
    if len(spec.spikes) >= int(option.get("max_skips", 0)):
        raise Forbidden(f"the job's spike.max_skips ({option.get('max_skips')}) is spent")
    most = int(option.get("skip_before", 0)) + 1
    if samples or len(steps) != 1 or steps[0][1] - steps[0][0] > most:
        raise BadRequest(f"a spike skips one stretch of at most skip_before + 1 = {most} steps, and no samples")


def _spike_record(spike: dict) -> dict:
    """A trainer's ``SkipJob.spike`` checked: ``{step, loss, median, window}``, numbers (or nan/inf names)."""

    def number(v: object) -> bool:
        return (isinstance(v, (int, float)) and not isinstance(v, bool)) or v in ("nan", "inf", "-inf")

    out = {k: spike.get(k) for k in ("step", "loss", "median", "window")}
    if not (isinstance(out["step"], int) and isinstance(out["window"], int) and number(out["loss"])):
        raise BadRequest(f"spike must be {{step, loss, median, window}}, got {str(spike)[:120]}")
    if not number(out["median"]):
        raise BadRequest(f"spike must be {{step, loss, median, window}}, got {str(spike)[:120]}")
    return out


def _spike_event(spike: dict, spec: JobSpec) -> str:
    """``spike: step K loss L, median M of the last W steps (n of at most N skipped)``."""
    loss, median = spike.get("loss"), spike.get("median")
    shown = f"{loss:.4g}" if isinstance(loss, float) else str(loss)
    med = f"{median:.4g}" if isinstance(median, float) else str(median)
    limit = spec.spike.get("max_skips", "?")
    return (
        f"spike: step {spike.get('step')} loss {shown}, median {med} of the last {spike.get('window')} "
        f"step(s) ({len(spec.spikes)} of at most {limit} spikes skipped)"
    )


def _steps_ranges(spec: JobSpec, segments: list[Segment], steps: list[list[int]], n: int) -> list[list[int]]:
    """The samples every rank trained at ``steps`` (checked: at most ``MAX_SKIP_STEPS``), as ranges;
    refused once they pass ``history.MAX_STEP_SAMPLES`` (a job of large batches), before more are looked up."""
    memo: dict = {}  # each rank's order and epoch computed once for all the steps
    parts: list[list[int]] = []
    total = 0
    for a, b in steps:
        for k in range(a, b):
            for entry in history.step_samples(spec, segments, k, n=n, memo=memo):
                parts.append(entry["indices"])
                total += len(entry["indices"])
            if total > history.MAX_STEP_SAMPLES:
                raise BadRequest(
                    f"steps {_shown_ranges(steps)} hold more than {history.MAX_STEP_SAMPLES} samples; "
                    "skip fewer steps at once, or name the samples (--samples a:b)"
                )
    return history.as_ranges([i for part in parts for i in part])


def _ranges(value: list, what: str, low: int = 0) -> list[list[int]]:
    """``[[a, b], ...]`` checked (``low <= a < b``, at most ``MAX_SKIP_RANGES``) and sorted."""
    if not isinstance(value, list) or len(value) > MAX_SKIP_RANGES:
        raise BadRequest(f"{what} must be a list of at most {MAX_SKIP_RANGES} [a, b] ranges")
    out = []
    for r in value:
        if not (
            isinstance(r, list)
            and len(r) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in r)
            and low <= r[0] < r[1]
        ):
            raise BadRequest(f"{what}: {str(r)[:80]} is not [a, b] with {low} <= a < b (a..b-1)")
        out.append([r[0], r[1]])
    return sorted(out)


def _shown_ranges(ranges: list[list[int]]) -> str:
    shown = ",".join(f"{a}:{b}" for a, b in ranges[:8])
    return shown + (f",... ({len(ranges)} ranges)" if len(ranges) > 8 else "")


def _order_size(spec: JobSpec, segments: list[Segment], split_size: Callable[[str], int | None]) -> int:
    """Samples the job's order is over: as a checkpoint cursor recorded it, else the train split's
    size (or the job's ``train_range``) as a live provider serves it."""
    for seg in reversed(segments):
        cursor = seg.get("cursor")
        if isinstance(cursor, dict) and isinstance(cursor.get("n"), int):
            return int(cursor["n"])
    if spec.train_range:
        return int(spec.train_range[1]) - int(spec.train_range[0])
    n = split_size(spec.dataset)
    if n is None:
        raise Unavailable(
            f"no provider of {spec.dataset!r} is online and job has no checkpoint yet: its split's size is unknown"
        )
    return n
