"""How a loader's batch replies become the tensors it yields: over the socket, or through a ring.

:class:`RemoteLoader` drives both the same way — ``fields`` for each request it sends, ``receive``
for each reply, ``hand_out`` when the batch is yielded and ``done`` when the consumer comes back
for the next — so the request pipeline (ordering, timeouts, resends) exists once.

- :class:`SocketDelivery`: the batch's bytes are the reply's frames; tensors view them.
- :class:`RingDelivery`: the provider wrote the batch into a slot of our shared-memory ring. On
  CPU the yielded tensors view the slot, and the slot returns to the ring only when the last tensor
  viewing it is freed (a weak reference on the arrays the tensors' storages own): a batch stays what
  it was for as long as it is held, as with ``torch.utils.data.DataLoader``. When the batches held
  would leave the pipeline no slot to request into, the batch is copied into fresh memory instead
  and its slot returns at once (never an overwrite, never a deadlock). ``copy=True`` always copies.
  With a CUDA device each filled slot is copied on a side stream into a fresh device tensor as soon
  as it arrives, and is free again when that copy's event completes: GPU batches are never reused.

A dataset of two fixed fields ``x``, ``y`` is yielded as ``(x, y)``, as above. Any other (named
fields, some of variable size or bytes/text: :mod:`libbus.wire.fields`) is yielded as a dict built by
:func:`libbus.loader.collate.collate`; through a ring its fields are copied out of the slot as the reply
arrives and the slot returns at once, so such a batch, too, stays valid while held.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from typing import Any

import numpy as np
import torch

from libbus.errors import BusError, ShmError
from libbus.loader.collate import check_collate, collate
from libbus.wire.fields import decode_frames, fields_of_info, is_xy, slot_bytes_for, unpack_slot
from libbus.wire.messages import AttachRing, BatchResponse, Message, frame_buffer
from shm import Ring, RingLayout

__all__ = ["RingDelivery", "SocketDelivery", "ring_layout"]

log = logging.getLogger(__name__)


def _check_response(reply: Message) -> BatchResponse:
    if not isinstance(reply, BatchResponse):
        raise BusError(f"expected BatchResponse, got {reply.type}")
    if reply.names is None and (len(reply.shapes) != 2 or len(reply.dtypes) != 2):
        raise BusError(f"malformed BatchResponse: {len(reply.shapes)} shapes, {len(reply.dtypes)} dtypes")
    return reply


def ring_layout(info: dict, batch_size: int, slots: int) -> RingLayout:
    """Slots that hold the largest batch of the dataset ``info`` describes: data + labels, or
    every named field within its declared maximum. Raises :class:`ShmError` for a dataset with a
    variable field that declares no maximum (its batches go over the socket)."""
    fields = fields_of_info(info)
    if is_xy(fields):
        x, y = fields
        return RingLayout.for_batch(slots, batch_size * x.sample_nbytes, batch_size * y.sample_nbytes)
    total = slot_bytes_for(fields, batch_size)
    if total is None:
        unsized = [f.name for f in fields if f.variable and not f.max_bytes]
        raise ShmError(f"field(s) {', '.join(unsized)} declare no max_bytes, so no ring slot size can hold a batch")
    return RingLayout.for_batch(slots, total, 0)


def _fields_out(reply: BatchResponse, batch: dict, how: str, device: torch.device) -> Any:
    """What the loader yields for a batch of named fields."""
    return collate(batch, reply.shapes, reply.dtypes, how, device)


class SocketDelivery:
    """Batches arrive as reply frames."""

    transport = "socket"

    def __init__(self, device: torch.device, collate: str = "pad"):
        self.device = device
        self.collate = check_collate(collate)

    @property
    def hand_out_in_consumer(self) -> bool:
        return False

    def can_send(self) -> bool:
        return True

    def can_take(self, batch_no: int) -> bool:
        return True

    def fields(self, batch_no: int) -> dict[str, int]:
        return {}

    def receive(self, batch_no: int, reply: Message) -> Any:
        reply = _check_response(reply)
        if reply.names is not None:
            if reply.slot is not None:
                raise BusError(f"malformed BatchResponse: names slot {reply.slot}; expected the batch in frames")
            batch = decode_frames(reply.names, reply.shapes, reply.dtypes, [frame_buffer(f) for f in reply.frames])
            return _fields_out(reply, batch, self.collate, self.device)
        if reply.slot is not None or len(reply.frames) != 2:
            raise BusError(
                f"malformed BatchResponse: {len(reply.frames)} frames, slot {reply.slot}; "
                "expected the batch in 2 frames"
            )
        out = []
        for frame, shape, dtype in zip(reply.frames, reply.shapes, reply.dtypes):
            buf = frame_buffer(frame)
            try:
                arr = np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)
            except (TypeError, ValueError) as err:
                raise BusError(f"malformed BatchResponse: {err}") from err
            tensor = torch.from_numpy(arr)
            out.append(tensor if self.device.type == "cpu" else tensor.to(self.device))
        return out[0], out[1]

    def hand_out(self, batch_no: int, item: Any) -> tuple[torch.Tensor, torch.Tensor] | dict:
        return item

    def done(self, batch_no: int) -> None:
        pass

    def wait_free(self) -> None:
        pass

    def reattach(self, client) -> None:
        pass

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Lease:
    """A slot handed out as views: it returns to the ring when both arrays the yielded tensors'
    storages own are collected, in whatever thread drops the last reference (a release is one
    store into the slot table and a ``deque.append``, both atomic under the GIL)."""

    __slots__ = ("slot", "left", "give_back")

    def __init__(self, slot: int, give_back):
        self.slot, self.left, self.give_back = slot, 2, give_back

    def drop(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.give_back(self.slot)


class RingDelivery:
    """Batches arrive in slots of a ring this process created and the provider attached.

    Args:
        ring: the ring (created here; closed and unlinked by :meth:`close`, its mapping kept while a
            yielded tensor still views it).
        device: where yielded tensors live.
        copy: on CPU, always yield copies instead of views of the slot.
    """

    transport = "shm"

    def __init__(self, ring: Ring, device: torch.device, copy: bool = False, collate: str = "pad"):
        self.ring = ring
        self.device = device
        self.copy = copy
        self.collate = check_collate(collate)
        self.free: deque[int] = deque(range(ring.layout.slots))
        self.slot_of: dict[int, int] = {}  # batch number -> its slot
        self.seq_of: dict[int, int] = {}  # batch number -> the sequence its slot awaits
        self.copies: deque[tuple[Any, int]] = deque()  # (CUDA event, slot) copies in flight
        #: Slots handed out as views and still viewed by a live tensor.
        self.leased: set[int] = set()
        #: Batches copied because the ones the user held left the pipeline no slot.
        self.copied = 0
        #: A batch is handed out as a view only if this many slots stay free or in flight.
        self.spare = 1
        self.closed = False
        #: Slots out of use for good: a provider that stopped answering may still write into them.
        self.quarantined: set[int] = set()
        self.stager = None
        if device.type == "cuda":
            from shm.cuda import CudaStager

            self.stager = CudaStager(ring.segment.mapping(), device)

    def attach_message(self) -> AttachRing:
        lay = self.ring.layout
        return AttachRing(
            name=self.ring.name, slots=lay.slots, slot_bytes=lay.slot_bytes, label_offset=lay.label_offset
        )

    def reattach(self, client) -> None:
        """A new session (after a reconnect) must attach the ring again before naming slots."""
        client.request(self.attach_message())

    # -- slots --------------------------------------------------------------------------------
    def _reap(self) -> None:
        while self.copies and self.copies[0][0].query():
            _, slot = self.copies.popleft()
            self._release(slot)

    def _release(self, slot: int) -> None:
        if self.closed:
            return  # a pass closed after its loader: nothing left to free
        self.ring.release(slot)
        self.free.append(slot)

    def _give_back(self, slot: int) -> None:
        """The last tensor viewing ``slot`` was freed (any thread, any time: never raises)."""
        self.leased.discard(slot)
        try:
            self._release(slot)
        except ShmError:  # the loader closed meanwhile
            pass

    @property
    def hand_out_in_consumer(self) -> bool:
        return self.stager is not None  # hand_over orders the consumer's CUDA stream after the copy

    def can_send(self) -> bool:
        self._reap()
        return bool(self.free)

    def can_take(self, batch_no: int) -> bool:
        """Whether ``batch_no`` can be sent now: it holds a slot already (a resend), or one is free."""
        return batch_no in self.slot_of or self.can_send()

    def quarantine(self, batch_nos: list[int]) -> None:
        """Take the slots of ``batch_nos`` out of use for good; the batches get fresh slots when sent
        again. For requests a provider left unanswered: it may be frozen in the middle of writing
        one of them (its ``seq`` check came before the write), and would finish that write into
        whatever the slot holds when it resumes."""
        for batch_no in batch_nos:
            slot = self.slot_of.pop(batch_no, None)
            self.seq_of.pop(batch_no, None)
            if slot is not None:
                self.quarantined.add(slot)

    @property
    def usable(self) -> int:
        """Slots not quarantined."""
        return self.ring.layout.slots - len(self.quarantined)

    def wait_free(self) -> None:
        """Block until a slot frees up (only CUDA copies hold slots without a request in flight;
        a slot the user holds is never waited for: :meth:`hand_out` copies before that)."""
        if self.copies:
            self.copies[0][0].synchronize()
            self._reap()

    def fields(self, batch_no: int) -> dict[str, int]:
        """Slot and sequence for (re)sending ``batch_no``: a resend gets a fresh sequence number,
        so a late answer to the earlier request is refused by the provider (and a slot that a slow
        provider filled for the lost connection is simply requested again)."""
        slot = self.slot_of.get(batch_no)
        if slot is None:
            slot = self.free.popleft()
            self.slot_of[batch_no] = slot
        seq = self.ring.request(slot)
        self.seq_of[batch_no] = seq
        return {"slot": slot, "seq": seq}

    def _views(self, batch_no: int, reply: BatchResponse):
        slot, seq = self.slot_of[batch_no], self.seq_of[batch_no]
        try:
            x, y = self.ring.views(
                slot, tuple(reply.shapes[0]), reply.dtypes[0], tuple(reply.shapes[1]), reply.dtypes[1]
            )
        except (ShmError, TypeError, ValueError) as err:
            raise BusError(f"malformed BatchResponse for slot {slot}: {err}") from err
        return slot, seq, x, y

    def receive(self, batch_no: int, reply: Message) -> Any:
        reply = _check_response(reply)
        slot, seq = self.slot_of[batch_no], self.seq_of[batch_no]
        if reply.slot != slot or reply.seq != seq or reply.frames:
            raise BusError(
                f"BatchResponse names slot {reply.slot} seq {reply.seq} with "
                f"{len(reply.frames)} frames; expected slot {slot} seq {seq}, no frames"
            )
        if reply.names is not None:  # named fields: copied out now, the slot is free again
            self.ring.take(slot, seq)
            try:
                with self.ring.slot_buffer(slot) as buf:
                    batch = unpack_slot(reply.names, reply.shapes, reply.dtypes, buf)
            finally:
                self._release(slot)
                self._forget(batch_no)
            return _fields_out(reply, batch, self.collate, self.device)
        if self.stager is None and not self.copy:
            return reply  # the slot stays FILLED until hand_out
        self.ring.take(slot, seq)
        _, _, x, y = self._views(batch_no, reply)
        if self.stager is not None:
            xc, yc, event = self.stager.copy(x, y)
            self.copies.append((event, slot))
            item: tuple = (xc, yc, event)
        else:
            item = (torch.from_numpy(x.copy()), torch.from_numpy(y.copy()))
            self._release(slot)
        self._forget(batch_no)
        return item

    def hand_out(self, batch_no: int, item: Any) -> tuple[torch.Tensor, torch.Tensor] | dict:
        if isinstance(item, dict):
            return item
        if isinstance(item, BatchResponse):
            slot = self.slot_of[batch_no]
            self.ring.take(slot, self.seq_of[batch_no])
            try:
                _, _, x, y = self._views(batch_no, item)
            finally:
                self._forget(batch_no)  # the slot is ours now: released below or with its views
            if len(self.free) + len(self.slot_of) < self.spare:
                # the batches the user holds leave no slot to request into: this one is a copy
                self.copied += 1
                out = torch.from_numpy(x.copy()), torch.from_numpy(y.copy())
                self._release(slot)
                return out
            # fresh arrays over the slot (the ring's are cached): their lives are the tensors' lives
            xv, yv = x.view(), y.view()
            lease = _Lease(slot, self._give_back)
            for view in (xv, yv):
                weakref.finalize(view, lease.drop).atexit = False
            self.leased.add(slot)
            return torch.from_numpy(xv), torch.from_numpy(yv)
        if self.stager is not None:
            xc, yc, event = item
            self.stager.hand_over(xc, yc, event)
            return xc, yc
        return item

    def done(self, batch_no: int) -> None:
        """The consumer asked for the next batch: a slot still named by ``batch_no`` (one not handed
        out as views: those return when the views are freed) is free again."""
        slot = self.slot_of.get(batch_no)
        if slot is not None:
            self._release(slot)
            self._forget(batch_no)

    def _forget(self, batch_no: int) -> None:
        self.slot_of.pop(batch_no, None)
        self.seq_of.pop(batch_no, None)

    def reset(self) -> None:
        """A pass ended early: every slot not in a CUDA copy is free; late replies are refused."""
        for slot in set(self.slot_of.values()):
            self._release(slot)
        self.slot_of.clear()
        self.seq_of.clear()

    def close(self) -> None:
        self.closed = True
        if self.stager is not None:
            self.stager.close()  # unregister before the ring is unmapped
        self.ring.close()
