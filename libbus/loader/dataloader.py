"""What a ``torch.utils.data.DataLoader`` user reaches for, met by :class:`~libbus.loader.remote.RemoteLoader`.

A script ported from a ``DataLoader`` keeps its habits: ``len(loader.dataset)`` is the split's
sample count (:class:`DatasetSplit`), a DataLoader argument given to ``RemoteLoader`` is answered by
the batchbus argument that does its job (:func:`refuse_dataloader_args`), and wrapping the loader in
a ``DataLoader`` that would batch its batches again fails at the first ``iter()`` with a message
naming ``batch_size=None`` (:func:`refuse_rebatching`), instead of yielding batches of one batch or
failing at the last one.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Mapping
from types import FrameType
from typing import Any

from libbus.errors import BadRequest

__all__ = ["DATALOADER_ARGS", "DatasetSplit", "pending_state", "refuse_dataloader_args", "refuse_rebatching"]

#: Each ``DataLoader`` argument that ``RemoteLoader`` does not take, and what does its job here.
DATALOADER_ARGS: dict[str, str] = {
    "sampler": "the order is the loader's own: shuffle= and seed= (a new order each epoch, set_epoch(n) to "
    "pick one), and rank=/world_size= (found from torch.distributed or RANK/WORLD_SIZE) for the shard",
    "batch_sampler": "batch_size= and drop_last= (the loader batches by itself)",
    "collate_fn": "batches arrive collated: collate='pad' or 'list' for variable-size fields, "
    "transform= for your own per-batch function",
    "num_workers": "inflight= (batch requests in flight; decoding and augmentation run on the providers, "
    "in a pipeline dataset's stages)",
    "prefetch_factor": "inflight= (batch requests kept in flight)",
    "persistent_workers": "nothing: the connections stay open between passes",
    "pin_memory": "device='cuda:N' (same-host batches come from pinned shared memory)",
    "pin_memory_device": "device=",
    "worker_init_fn": "nothing runs in workers: per-sample code belongs in a provider pipeline's user stage",
    "generator": "seed= (the order of every epoch is drawn from (seed, epoch))",
    "timeout": "timeout_s= (per request) and provider_wait_s= (for a provider to come back)",
    "multiprocessing_context": "nothing: there are no worker processes",
    "in_order": "nothing: batches are always yielded in order",
}


def refuse_dataloader_args(given: Mapping[str, Any]) -> None:
    """Raise for keyword arguments ``RemoteLoader`` does not take: a ``DataLoader`` argument's
    message names its batchbus equivalent.

    Raises:
        BadRequest: a ``DataLoader`` argument, naming what replaces it.
        TypeError: any other unknown keyword, as Python would.
    """
    for name in given:
        if name in DATALOADER_ARGS:
            raise BadRequest(f"RemoteLoader takes no {name}= (a DataLoader argument); use {DATALOADER_ARGS[name]}")
    if given:
        raise TypeError(f"RemoteLoader() got an unexpected keyword argument {next(iter(given))!r}")


#: How far up the stack :func:`refuse_rebatching` looks for the DataLoader iterator that called ``iter()``,
#: and the modules whose frames it reads.
_FRAMES = 8
_DATALOADER_MODULES = ("torch.utils.data.", "torchdata.")


def refuse_rebatching(dataset: object) -> None:
    """Raise if ``dataset`` is being iterated by a ``DataLoader`` that batches what it yields (its
    ``batch_size`` is not ``None``): each item would become a batch of one batch.

    The DataLoader's iterator is found among the callers of ``iter(dataset)`` (torch's
    ``_BaseDataLoaderIter``, which torchdata's ``StatefulDataLoader`` iterators subclass, and whose
    ``_auto_collation`` is on when it batches). Where torch lays this out otherwise, nothing is found
    and nothing is refused.

    Raises:
        BadRequest: naming ``batch_size=None``.
    """
    dataloader = sys.modules.get("torch.utils.data.dataloader")
    base = getattr(dataloader, "_BaseDataLoaderIter", None)
    if base is None:
        return
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_FRAMES):
        if frame is None:
            return
        if not frame.f_globals.get("__name__", "").startswith(_DATALOADER_MODULES):
            # never f_locals of other frames: it caches their locals on the frame (a script's
            # tensors, a slot they view) until that frame runs on
            frame = frame.f_back
            continue
        it = frame.f_locals.get("self")
        if isinstance(it, base) and getattr(it, "_dataset", None) is dataset:
            if getattr(it, "_auto_collation", False):
                raise BadRequest(
                    "RemoteLoader yields whole batches: wrap it as DataLoader(loader, batch_size=None) "
                    "(or iterate the loader itself); set the batch size with RemoteLoader(batch_size=...)"
                )
            return
        frame = frame.f_back


#: The module of torchdata's ``StatefulDataLoader`` and the key its state keeps a dataset's state under.
_STATEFUL_MODULE = "torchdata.stateful_dataloader.stateful_dataloader"
_DATASET_STATE = "dataset_state"


def pending_state(dataset: object) -> Mapping[str, Any] | None:
    """The state of ``dataset`` that a torchdata ``StatefulDataLoader`` wrapping it was given with
    ``load_state_dict`` and keeps for its next ``iter()``, or ``None``.

    ``StatefulDataLoader`` loads a state lazily, so without this the dataset reads its old cursor
    until then. The wrappers are found among the objects referring to ``dataset`` (a scan of the
    garbage collector's objects, tens of milliseconds in a large process): look only before a
    first pass, and only when torchdata is imported.
    """
    module = sys.modules.get(_STATEFUL_MODULE)
    wrapper_type = getattr(module, "StatefulDataLoader", None)
    if wrapper_type is None:
        return None
    for holder in gc.get_referrers(dataset):
        if isinstance(holder, wrapper_type) and getattr(holder, "dataset", None) is dataset:
            pending = getattr(holder, "next_iter_state", None)
            state = pending.get(_DATASET_STATE) if isinstance(pending, Mapping) else None
            if isinstance(state, Mapping):
                return state
    return None


class DatasetSplit:
    """``loader.dataset``: one split of a served dataset. ``len()`` is the split's sample count on
    the provider (every rank's, as ``len(dataset)`` of a map-style dataset under a
    ``DistributedSampler``); ``str()`` and ``name`` its name; ``info`` the provider's DatasetInfo."""

    def __init__(self, name: str, split: str, num_samples: int, info: Mapping[str, Any]):
        self.name, self.split, self.num_samples, self.info = name, split, num_samples, info

    def __len__(self) -> int:
        return self.num_samples

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"DatasetSplit({self.name!r}, split={self.split!r}, num_samples={self.num_samples})"
