"""Elastic cursors: an epoch saved under world size W continues under any W′, every sample once.

An epoch's order (:func:`~libbus.order.epochs.epoch_order` of the whole split, the same on every rank) is
cut into contiguous per-rank slices, and a rank's cursor is how many samples of its slice it has
delivered. So the W cursors of a world say exactly which positions of the epoch's order were
consumed — a prefix of each slice — and which were not. This module keeps, per epoch, a **plan**:
the positions of the epoch's order still to read, as ``[start, stop)`` ranges (``None``: all of
them). Ranks cut the plan into slices the way they cut a whole epoch (:func:`~libbus.order.epochs.shard_bounds`).

Resuming under another world size merges the saved cursors into one plan of what is left (the
unconsumed end of each old rank's slice, in order) and re-splits it over the new ranks; the next
epoch is whole again. A merged cursor (:func:`merge`) is itself a valid cursor: the state of a
single rank at position 0 of the remaining plan, loadable under any world size.

One rank's cursor alone (what most checkpointing saves: rank 0's) stands for all ranks at the same
position — true of ranks in lock-step, which take the same number of equal batches (the default:
equal batch counts; a rank whose slice is one sample shorter stops at its end).

With ``drop_uneven``, each split of a plan leaves out its last ``len(plan) % W′`` positions, as a
whole epoch does: every sample at most once, and the same batch count on every rank.

Skips (``Order.skip``): the plan's positions whose samples are skipped are left out before the plan is
cut into slices, so the slices stay disjoint and equal. A cursor records how many skips it was saved
under (and their digest); resumed under more (a job told to skip a stretch), it is merged under its own
skips into the plan of what no rank consumed — positions of the epoch's order, which do not move when
samples are skipped — and that plan is read under all of them: the epoch otherwise unchanged, every
other sample once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from libbus.errors import BadRequest
from libbus.order.epochs import (
    Order,
    Shuffle,
    batches_of,
    epoch_order,
    kept_mask,
    shard_bounds,
    skip_ranges,
    skips_digest,
)

__all__ = ["Plan", "indices", "merge", "merge_cursors", "num_batches", "restore", "state"]

#: Ranges ``[[start, stop), ...]`` of positions in an epoch's order; ``None`` means the whole epoch.
Plan = list[list[int]] | None

#: Version of a cursor that may carry a plan (version 1 cursors, without one, are still read).
ELASTIC_VERSION = 2
_SETTINGS = ("n", "seed", "shuffle", "block_size", "drop_uneven")


def _length(plan: Plan, n: int) -> int:
    return n if plan is None else sum(b - a for a, b in plan)


def _positions(plan: Plan, n: int) -> np.ndarray:
    if plan is None:
        return np.arange(n, dtype=np.int64)
    parts = [np.arange(a, b, dtype=np.int64) for a, b in plan]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def _slice(plan: Plan, n: int, lo: int, hi: int) -> list[list[int]]:
    """Positions ``lo..hi`` of the plan (counted along it), as ranges of the epoch's order."""
    out, at = [], 0
    for a, b in [[0, n]] if plan is None else plan:
        start, stop = max(a, a + lo - at), min(b, a + hi - at)
        if start < stop:
            out.append([start, stop])
        at += b - a
    return out


def _whole(order: Order, epoch: int) -> np.ndarray:
    return epoch_order(order.n, epoch=epoch, seed=order.seed, shuffle=order.shuffle, block_size=order.block_size)


def _read(order: Order, epoch: int, plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Under skips: the epoch's whole order, the plan's positions, and where along them the kept ones are."""
    whole = _whole(order, epoch)
    positions = _positions(plan, order.n)
    along = np.flatnonzero(kept_mask(whole[positions], skip_ranges(order.skip)))
    return whole, positions, along


def _length_read(order: Order, plan: Plan, epoch: int) -> int:
    """Samples the plan yields to all ranks together (its skipped ones left out)."""
    if not order.skip:
        return _length(plan, order.n)
    if plan is None:
        return order.kept
    return len(_read(order, epoch, plan)[2])


def _bounds(
    order: Order, plan: Plan, rank: int, world_size: int, drop_uneven: bool | None = None, epoch: int = 0
) -> tuple[int, int]:
    uneven = order.drop_uneven if drop_uneven is None else drop_uneven
    return shard_bounds(_length_read(order, plan, epoch), rank=rank, world_size=world_size, drop_uneven=uneven)


def indices(order: Order, epoch: int, plan: Plan) -> np.ndarray:
    """The sample indices ``order``'s rank reads in ``epoch`` under ``plan``."""
    if plan is None:
        return order.indices(epoch)
    if order.skip:
        whole, positions, along = _read(order, epoch, plan)
        lo, hi = shard_bounds(len(along), rank=order.rank, world_size=order.world_size, drop_uneven=order.drop_uneven)
        return whole[positions[along[lo:hi]]]
    whole = _whole(order, epoch)
    lo, hi = _bounds(order, plan, order.rank, order.world_size)
    return whole[_positions(plan, order.n)[lo:hi]]


def num_batches(order: Order, plan: Plan, start: int = 0, epoch: int = 0) -> int:
    """Batches ``order``'s rank yields under ``plan`` in ``epoch`` after its first ``start`` samples."""
    lo, hi = _bounds(order, plan, order.rank, order.world_size, epoch=epoch)
    return len(batches_of(np.empty(hi - lo), order.batch_size, order.drop_last, start=min(start, hi - lo)))


def state(order: Order, epoch: int, position: int, plan: Plan) -> dict[str, Any]:
    """``order``'s cursor as a JSON-ready dict (version 2: with its ``plan``, ``None`` for a whole
    epoch). The keys are the same whatever the plan, so a checkpointer that loads into the shape of
    a fresh loader's ``state_dict()`` (``torch.distributed.checkpoint``) loads every one of them."""
    out = order.state(epoch, position)
    out.update(version=ELASTIC_VERSION, plan=None if plan is None else [list(r) for r in plan])
    return out


def _check(order: Order, saved: Any) -> Mapping[str, Any]:
    if not isinstance(saved, Mapping):
        raise BadRequest(f"loader state must be a mapping (or a list of one per rank), got {type(saved).__name__}")
    if saved.get("version") not in (1, ELASTIC_VERSION):
        raise BadRequest(f"loader state version {saved.get('version')!r} is not 1 or {ELASTIC_VERSION}")
    missing = [k for k in ("epoch", "position", "world_size", "rank", *_SETTINGS) if k not in saved]
    if missing:
        raise BadRequest(f"loader state lacks {', '.join(missing)}")
    mine = {"n": order.n, "seed": order.seed, "shuffle": str(order.shuffle), "block_size": order.block_size}
    mine["drop_uneven"] = order.drop_uneven
    # drop_uneven decides the old world's slices only: it must match only within the same world size
    checked = [k for k in _SETTINGS if k != "block_size" or order.shuffle is Shuffle.BLOCK]
    if saved.get("world_size") != order.world_size or order.world_size == 1:
        checked.remove("drop_uneven")
    differ = [f"{k} was {saved[k]!r}, is {mine[k]!r}" for k in checked if saved[k] != mine[k]]
    if differ:
        raise BadRequest(
            f"loader state was saved under other settings, so its position would point at other samples: "
            f"{'; '.join(differ)}"
        )
    saved_skips = saved.get("skips", 0)
    if (
        isinstance(saved_skips, bool)
        or not isinstance(saved_skips, int)
        or not 0 <= saved_skips <= len(order.skip)
        or (saved_skips and saved.get("skips_digest") != skips_digest(order.skip[:saved_skips]))
    ):
        raise BadRequest(
            f"loader state was saved under skips ({saved_skips!r} of them) that are not the first of this "
            f"loader's {len(order.skip)}: skips are only ever added, in the same order"
        )
    plan = saved.get("plan")
    if plan is not None:
        ok = isinstance(plan, list) and all(
            isinstance(r, (list, tuple)) and len(r) == 2 and 0 <= r[0] <= r[1] <= order.n for r in plan
        )
        if not ok:
            raise BadRequest(f"loader state's plan must be [start, stop) ranges within 0..{order.n}")
    return saved


def merge(order: Order, states: Sequence[Mapping[str, Any]] | Mapping[str, Any]) -> dict[str, Any]:
    """One cursor for the whole world from its ranks' cursors (or from one rank's, standing for all
    ranks at its position): what no rank has consumed of the epoch, loadable at any world size.

    Raises:
        BadRequest: a cursor saved under other settings, cursors of different epochs, plans or
            world sizes, or a list that is not one cursor per rank ``0..W-1``.
    """
    if isinstance(states, Mapping):
        one = _check(order, states)
        world = int(one["world_size"])
        states = [{**one, "rank": r} for r in range(world)]
    states = [_check(order, s) for s in states]
    if not states:
        raise BadRequest("no loader state to merge")
    states = _finished_as_ends(order, states)
    first = states[0]
    world = int(first["world_size"])
    for key in ("epoch", "world_size", "plan", "drop_uneven"):
        if any(s.get(key) != first.get(key) for s in states):
            raise BadRequest(f"loader states to merge differ in {key}: {sorted({str(s.get(key)) for s in states})}")
    ranks = sorted(int(s["rank"]) for s in states)
    if ranks != list(range(world)):
        raise BadRequest(f"merging needs one loader state per rank 0..{world - 1}, got ranks {ranks}")
    plan = first.get("plan")
    epoch = int(first["epoch"])
    left: list[list[int]] = []
    if any(int(s.get("skips", 0)) != int(first.get("skips", 0)) for s in states):
        raise BadRequest("loader states to merge were saved under different skips")
    # the positions consumed are counted under the skips the cursors were saved under
    old = Order(**{**_order_fields(order), "skip": order.skip[: int(first.get("skips", 0))]})
    if old.skip:
        _, _, along = _read(old, epoch, plan)
        end = _length(plan, order.n)
        for s in sorted(states, key=lambda s: int(s["rank"])):
            lo, hi = shard_bounds(len(along), rank=int(s["rank"]), world_size=world, drop_uneven=bool(s["drop_uneven"]))
            stop = end if hi == len(along) else int(along[hi]) if hi < len(along) else end
            at = lo + int(s["position"])
            left += _slice(plan, order.n, int(along[at]) if at < hi else stop, stop)
    else:
        for s in sorted(states, key=lambda s: int(s["rank"])):
            lo, hi = _bounds(old, plan, int(s["rank"]), world, bool(s["drop_uneven"]))
            left += _slice(plan, order.n, min(hi, lo + int(s["position"])), hi)
    single = Order(**{**_order_fields(order), "rank": 0, "world_size": 1, "drop_uneven": False})
    if not left and any(int(s["position"]) for s in states):  # the epoch is over: the next one, whole
        return state(single, epoch + 1, 0, None)
    return state(single, epoch, 0, left)


def _finished_as_ends(order: Order, states: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """A rank saved at the start of epoch e+1 while others were still in e has finished its slice
    of e: it is read as at the end of that slice (and its plan is e's, which it no longer records)."""
    epochs = {int(s["epoch"]) for s in states}
    if len(epochs) != 2 or max(epochs) != min(epochs) + 1:
        return states
    behind = [s for s in states if int(s["epoch"]) == min(epochs)]
    plan, world = behind[0].get("plan"), int(behind[0]["world_size"])
    out = []
    for s in states:
        if int(s["epoch"]) == min(epochs):
            out.append(s)
        elif int(s["position"]) == 0:
            old = Order(**{**_order_fields(order), "skip": order.skip[: int(s.get("skips", 0))]})
            lo, hi = _bounds(old, plan, int(s["rank"]), world, bool(s["drop_uneven"]), epoch=min(epochs))
            out.append({**s, "epoch": min(epochs), "position": hi - lo, "plan": plan})
        else:
            raise BadRequest(
                f"rank {s['rank']} is {s['position']} samples into epoch {s['epoch']} while others are in {min(epochs)}"
            )
    return out


def _order_fields(order: Order) -> dict[str, Any]:
    return {
        "n": order.n,
        "seed": order.seed,
        "shuffle": order.shuffle,
        "block_size": order.block_size,
        "rank": order.rank,
        "world_size": order.world_size,
        "batch_size": order.batch_size,
        "drop_last": order.drop_last,
        "drop_uneven": order.drop_uneven,
        "skip": order.skip,
    }


def restore(order: Order, saved: Any) -> tuple[int, int, Plan]:
    """``(epoch, position, plan)`` for ``order``'s rank to continue from ``saved``: one cursor (this
    world size: its position, as before; another: see :func:`merge`), or a list of one per rank.

    Raises:
        BadRequest: as :func:`merge`, or a position past the end of the rank's slice.
    """
    if isinstance(saved, Mapping):
        one = _check(order, saved)
        if int(one["world_size"]) == order.world_size and int(one.get("skips", 0)) == len(order.skip):
            plan = one.get("plan")
            epoch, position = int(one["epoch"]), int(one["position"])
            lo, hi = _bounds(order, plan, order.rank, order.world_size, epoch=epoch)
            longest = _bounds(order, plan, 0, order.world_size, epoch=epoch)
            if epoch < 0 or position < 0 or position > longest[1] - longest[0]:
                raise BadRequest(f"position {position} is past the end of this rank's {hi - lo} samples")
            if position > 0 and num_batches(order, plan, position, epoch) == 0:
                return epoch + 1, 0, None  # a finished epoch is the start of the next
            return epoch, position, plan
    elif not isinstance(saved, Sequence) or isinstance(saved, (str, bytes)):
        raise BadRequest(f"loader state must be a mapping or a list of one per rank, got {type(saved).__name__}")
    else:
        mine = [s for s in saved if isinstance(s, Mapping) and s.get("rank") == order.rank]
        if (
            len(saved) == order.world_size
            and len(mine) == 1
            and mine[0].get("world_size") == order.world_size
            and int(mine[0].get("skips", 0)) == len(order.skip)
        ):
            merge(order, saved)  # checks the list is one consistent world
            return restore(order, mine[0])  # the same world: each rank at its own position
    merged = merge(order, saved)
    return int(merged["epoch"]), 0, merged.get("plan")


def merge_cursors(states: Sequence[Mapping[str, Any]] | Mapping[str, Any]) -> dict[str, Any]:
    """One cursor from every rank's :meth:`~libbus.loader.remote.RemoteLoader.state_dict` (or one rank's,
    standing for all in lock-step): what no rank has read of the epoch, loadable at any world size
    with ``load_state_dict``. The settings come from the cursors themselves.

    Raises:
        BadRequest: as :func:`merge`; also for an empty list or cursors without their settings.
    """
    first = states if isinstance(states, Mapping) else (states[0] if states else None)
    if not isinstance(first, Mapping) or any(k not in first for k in ("world_size", *_SETTINGS)):
        raise BadRequest("merge_cursors needs the loader states (state_dict()) of every rank")
    if first.get("skips"):
        raise BadRequest("cursors saved under skips are merged by a loader given the same skips: load_state_dict")
    try:
        order = Order(
            n=first["n"],
            seed=first["seed"],
            shuffle=first["shuffle"],
            block_size=first["block_size"],
            world_size=first["world_size"],
            drop_uneven=first["drop_uneven"],
        )
    except TypeError as err:
        raise BadRequest(f"loader state holds a malformed setting: {err}") from err
    return merge(order, states)
