"""Which samples made step k: derived from a job's order and its segments, never logged per sample.

A job's steps run in **segments**: each attempt starts one, at the step of the checkpoint it resumes
(0 on a first attempt), from that checkpoint's loader cursor (``None``: the start of epoch 0), under
the attempt's world size and batch size. Within a segment every rank takes one batch per step from
its loader, so step ``k`` of rank ``r`` is the ``(k - start)``-th batch that rank reads after the
segment's cursor: the batches left of the cursor's epoch (its plan re-split over the world, as the
loader does on resume, :func:`libbus.order.elastic.restore`), then whole epochs.

Step ``k`` belongs to the segment recorded last among those starting before it: a later attempt
resumed from step ``S`` replaces what earlier ones trained after ``S`` (that model state was lost),
so the answer is what the job's model was (or will be) trained on at step ``k``.

A segment is a plain dict (the router keeps them per job, services/router/store.py)::

    {"step": 30, "world_size": 2, "batch_size": 16, "cursor": {...} or None, "skips": 1}

``skips``: how many of the spec's ``skip`` list the attempt's loaders left out (libbus/order/epochs.py).

Steps count from 1 (step ``k`` is the ``k``-th optimizer step, the audit's ``step``). Indices are
the split's sample indices (a ``train_range`` job's order is over its range; ``first`` is added).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypedDict

import numpy as np

from libbus.errors import BadRequest, NotFound
from libbus.order import elastic
from libbus.order.epochs import Order, batches_of, check_skips, epoch_order, shift_skips, skip_ranges

__all__ = [
    "OrderSpec",
    "StepSample",
    "MAX_ORDER_SAMPLES",
    "MAX_RANGE",
    "MAX_SKIP_STEPS",
    "MAX_STEP_SAMPLES",
    "as_ranges",
    "epoch_range",
    "segment_of",
    "step_samples",
    "union_ranges",
]

#: The most steps one skip may name (each step's samples are looked up), and the most samples
#: they may hold in all (every rank's batch of every step: looked up index by index).
MAX_SKIP_STEPS = 10_000
MAX_STEP_SAMPLES = 1 << 20

#: The most positions one ``epoch_range`` query returns (a reply stays small).
MAX_RANGE = 100_000

#: The largest order (samples of an epoch) the router computes to answer a lookup, on its loop: an
#: epoch's order is the whole split's (at this bound 2 s and 130 MiB on a loaded 2-core machine), and its
#: size is a job's ``train_range`` (any tenant's to choose) or the ``n`` its checkpoint's cursor reports
#: (the job's code): past it a lookup is refused before anything is computed (one of 10^12 samples
#: asked 7 TiB, 2e9 samples would ask 16 GiB).
MAX_ORDER_SAMPLES = 1 << 24


def _check_order_size(n: int) -> None:
    if n > MAX_ORDER_SAMPLES:
        raise BadRequest(
            f"the job's order is over {n} samples; the router looks up samples in orders of at most "
            f"{MAX_ORDER_SAMPLES} (each lookup computes an epoch's whole order): compute it where the "
            "job's loaders do (libbus.order.epochs.epoch_order)"
        )


def segment_of(segments: Sequence[Mapping[str, Any]], step: int) -> Mapping[str, Any]:
    """The segment that trained ``step``: the last recorded one that starts before it.

    Raises:
        BadRequest: ``step`` below 1.
        NotFound: no segment starts before ``step`` (none recorded, or the oldest were dropped).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise BadRequest(f"steps count from 1, got {step!r}")
    for seg in reversed(segments):
        if int(seg.get("step", 0)) < step:
            return seg
    if not segments:
        raise NotFound("the job has no recorded attempt yet: no step has an order")
    raise NotFound(f"step {step} is before the oldest segment kept (step {segments[0].get('step')})")


class OrderSpec(Protocol):
    """What of a job's spec its order is made of (a :class:`libbus.jobs.spec.JobSpec`, typed: this floor
    sits below ``libbus.jobs``)."""

    seed: int
    shuffle: str
    block_size: int
    batch_size: int
    epochs: int
    train_range: list
    skip: list


class StepSample(TypedDict):
    """A rank's samples of a step (:func:`step_samples`, ``JobSamples.samples``): the rank, the world and the
    segment's first step it trained under, the epoch and the first sample's place in the rank's share of it,
    and the sample indices (epoch and position None, indices empty, where the rank's epochs ran out first)."""

    rank: int
    world_size: int
    segment_step: int
    epoch: int | None
    position: int | None
    indices: list[int]


def _first(spec: OrderSpec) -> int:
    """The first sample index of the job's order (its ``train_range``'s start, else 0)."""
    return int(spec.train_range[0]) if spec.train_range else 0


def _order(spec: OrderSpec, n: int, seg: Mapping[str, Any], rank: int) -> Order:
    world = int(seg.get("world_size", 1))
    # the skips the attempt's loader had: the spec's first ``skips`` (skips are only ever added)
    skips = check_skips(list(spec.skip)[: int(seg.get("skips", 0))])
    return Order(
        n=n,
        seed=spec.seed,
        shuffle=spec.shuffle,
        block_size=spec.block_size,
        rank=rank,
        world_size=world,
        batch_size=int(seg.get("batch_size") or spec.batch_size),
        drop_uneven=world > 1,  # what a gang's loaders read (services/trainer/attempt/prepare.py: shard)
        skip=shift_skips(skips, _first(spec), n),
    )


def step_samples(
    spec: OrderSpec,
    segments: Sequence[Mapping[str, Any]],
    step: int,
    *,
    n: int,
    rank: int | None = None,
    memo: dict | None = None,
) -> list[StepSample]:
    """The samples of ``step``: one entry per rank (or only ``rank``), each
    ``{"rank", "epoch", "position", "indices": [...]}`` (``position``: the first sample's place in the
    rank's share of the epoch), or ``indices`` empty where that rank's epochs ran out first.

    Args:
        spec: the job's spec (``seed``, ``shuffle``, ``block_size``, ``batch_size``, ``train_range``).
        segments: the job's segments, oldest first (see the module docstring).
        n: samples the job's order is over (its train split, or its ``train_range``).
        memo: a dict shared by the calls for one request's steps (ascending, of the same
            ``segments``): each rank's order and each epoch's batches are then computed once, not
            once a step (an epoch's order is the whole split's).

    Raises:
        BadRequest: ``step`` below 1, ``rank`` outside the segment's world, an order past
            :data:`MAX_ORDER_SAMPLES`.
        NotFound: no segment covers ``step``.
    """
    _check_order_size(n)
    seg = segment_of(segments, step)
    world = int(seg.get("world_size", 1))
    if rank is not None and not 0 <= rank < world:
        raise BadRequest(f"rank {rank} is outside the world of {world} that trained step {step}")
    first = _first(spec)
    epochs = spec.epochs or None
    memo = {} if memo is None else memo
    out: list[StepSample] = []
    for r in range(world) if rank is None else [rank]:
        key = (id(seg), r)
        if key not in memo:  # the rank's order and where the segment's cursor left it
            order = _order(spec, n, seg, r)
            cursor = seg.get("cursor")
            memo[key] = (order, *(elastic.restore(order, cursor) if cursor else (0, 0, None)))
        order, epoch, position, plan = memo[key]
        left = step - int(seg.get("step", 0)) - 1  # batches to pass over after the cursor
        batch, at = _nth_batch(order, epoch, position, plan, left, epochs, memo, key)
        entry: StepSample = {
            "rank": r,
            "world_size": world,
            "segment_step": int(seg.get("step", 0)),
            "epoch": None,
            "position": None,
            "indices": [],
        }
        if batch is not None:
            entry["epoch"], entry["position"], entry["indices"] = at[0], at[1], (batch + first).tolist()
        out.append(entry)
    return out


def _nth_batch(
    order: Order,
    epoch: int,
    position: int,
    plan: elastic.Plan,
    left: int,
    epochs: int | None,
    memo: dict,
    key: tuple,
) -> tuple[np.ndarray | None, tuple[int, int]]:
    """The ``left``-th batch (from 0) after ``(epoch, position, plan)``, with its ``(epoch, position)``;
    ``memo`` keeps the cursor's epoch's batches and the latest whole epoch's under ``key``."""
    if (key, "first") not in memo:
        indices = elastic.indices(order, epoch, plan)
        memo[key, "first"] = batches_of(indices, order.batch_size, order.drop_last, start=position)
    batches = memo[key, "first"]
    if left < len(batches):
        return batches[left], (epoch, position + left * order.batch_size)
    left -= len(batches)
    whole = order.num_batches()
    if whole == 0:
        return None, (epoch, 0)
    epoch += 1 + left // whole
    left %= whole
    if epochs is not None and epoch >= epochs:
        return None, (epoch, 0)
    held = memo.get((key, "epoch"))
    if held is None or held[0] != epoch:  # one whole epoch held at a time: steps come in order
        held = memo[key, "epoch"] = (epoch, order.batches(epoch))
    return held[1][left], (epoch, left * order.batch_size)


def epoch_range(spec: OrderSpec, epoch: int, start: int, stop: int, *, n: int) -> list[int]:
    """Positions ``start..stop`` of ``epoch``'s whole order (all ranks together, before any resume
    re-split it): the split's indices there.

    Raises:
        BadRequest: a malformed or over-long range (at most :data:`MAX_RANGE` positions), or an
            order past :data:`MAX_ORDER_SAMPLES`.
    """
    _check_order_size(n)
    if not (0 <= start <= stop <= n):
        raise BadRequest(f"range {start}:{stop} must lie within 0:{n} (the epoch's {n} positions)")
    if stop - start > MAX_RANGE:
        raise BadRequest(f"range {start}:{stop} has {stop - start} positions; ask for at most {MAX_RANGE} at once")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise BadRequest(f"epoch must be 0 or more, got {epoch!r}")
    whole = epoch_order(
        n,
        epoch=epoch,
        seed=spec.seed,
        shuffle=spec.shuffle,
        block_size=spec.block_size,
    )
    first = _first(spec)
    return (whole[start:stop] + first).tolist()


def union_ranges(*ranges: Sequence[Sequence[int]]) -> list[list[int]]:
    """The union of lists of ``[start, stop)`` ranges as sorted, disjoint ranges (touching ones
    joined), by their bounds alone: a range of millions of indices costs what a range of one does."""
    merged = skip_ranges(tuple(tuple((int(a), int(b)) for a, b in one) for one in ranges))
    return merged.tolist()


def as_ranges(indices: Sequence[int] | np.ndarray) -> list[list[int]]:
    """``indices`` as sorted, disjoint ``[start, stop)`` ranges (runs of consecutive indices joined)."""
    values = np.unique(np.asarray(indices, dtype=np.int64))
    if not len(values):
        return []
    breaks = np.flatnonzero(np.diff(values) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [len(values)]])
    return [[int(values[a]), int(values[b - 1]) + 1] for a, b in zip(starts, stops, strict=True)]
