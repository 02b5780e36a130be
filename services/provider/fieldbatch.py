"""A BatchResponse for a dataset of named fields: every field read, then encoded as frames or packed
into the trainer's ring slot (:mod:`libbus.wire.fields`). The provider's handler counts and times it."""

from __future__ import annotations

from collections import Counter

import numpy as np

from libbus.constants import MAX_BATCH_BYTES, MAX_FRAMES
from libbus.errors import BadRequest, BusError, ConfigError, ShmError, TooLarge
from libbus.wire.fields import Field, encode_frames, pack_slot
from libbus.wire.messages import BatchRequest, BatchResponse
from shm import Ring

from .sources import Source

__all__ = ["begin_fill", "check_frames", "check_servable", "fields_reply"]


def check_frames(dataset: str, fields: list[Field]) -> None:
    """Refuse (at start-up) a dataset whose batches would need more payload frames than a message
    may carry: one per fixed field, two per variable one, at most ``MAX_FRAMES - 2``."""
    need = sum(2 if f.variable else 1 for f in fields)
    if need > MAX_FRAMES - 2:
        raise ConfigError(
            f"dataset {dataset!r} has {len(fields)} fields, whose batches need {need} frames; a message "
            f"carries at most {MAX_FRAMES - 2} (one per fixed field, two per variable one): serve fewer"
        )


def check_servable(dataset: str, source: Source) -> None:
    """Refuse (at start-up) a dataset of encoded images or text, alone or mixed: they have no fixed
    shape and feed a pipeline's ``decode`` or ``tokenize`` stage; served as they are, every batch
    would fail."""
    if source.kind == "encoded":
        raise ConfigError(
            f"dataset {dataset!r} ({source.uri}) holds encoded images or text, which have no fixed shape: "
            "make it a pipeline's source (decode or tokenize stages: docs/datasets.md §9.3, §9.4), or serve "
            "images with ?size=S or ?fields=image,label"
        )


def fields_reply(
    source: Source,
    fields: list[Field],
    msg: BatchRequest,
    indices: np.ndarray,
    ring: Ring | None,
    refused: Counter,
    begun: bool = False,
) -> BatchResponse:
    """Read the batch and answer it. A stale slot is ``BAD_REQUEST`` (``batch not written``); a
    batch beyond the declared maxima, the slot or the batch limit ``TOO_LARGE`` naming the field and
    sizes; each counted in ``refused``. ``begun``: the slot's fill was begun already (:func:`begin_fill`,
    on the serving loop, when the rest runs off it)."""
    if ring is not None and not begun:
        begin_fill(ring, msg, refused)
    batch = source.read_fields(msg.split, indices, msg.epoch)
    n = len(indices)
    try:
        if ring is None:
            frames, shapes, dtypes, nbytes = encode_frames(fields, batch, n)
            if nbytes > MAX_BATCH_BYTES:
                raise TooLarge(f"a batch of {n} samples is {nbytes} bytes; the batch limit is {MAX_BATCH_BYTES}")
        else:
            with ring.slot_buffer(msg.slot) as buf:  # type: ignore[arg-type]
                shapes, dtypes, nbytes = pack_slot(fields, batch, n, buf)
            frames = []
    except ShmError as err:
        refused["stale_slot"] += 1
        raise BadRequest(f"batch not written: {err}") from err
    except TooLarge as err:
        refused["too_large"] += 1
        raise TooLarge(f"{msg.dataset}/{msg.split}: {err}") from err
    except BusError as err:  # a source serving what its fields do not declare
        raise BadRequest(f"{msg.dataset}/{msg.split}: {err}") from err
    if ring is not None:
        _stale_checked(ring.finish_fill, msg, refused)
    return BatchResponse(
        names=[f.name for f in fields], shapes=shapes, dtypes=dtypes, nbytes=nbytes, slot=msg.slot, seq=msg.seq,
        frames=frames,
    )  # fmt: skip


def begin_fill(ring: Ring, msg: BatchRequest, refused: Counter) -> None:
    """Mark the request's slot as being filled, or refuse a stale one (``batch not written``)."""
    _stale_checked(ring.begin_fill, msg, refused)


def _stale_checked(check, msg: BatchRequest, refused: Counter) -> None:
    try:
        check(msg.slot, msg.seq)
    except ShmError as err:
        refused["stale_slot"] += 1
        raise BadRequest(f"batch not written: {err}") from err
