"""Checkpoints and final models on the trainer's disk: safetensors only, written atomically.

A checkpoint is ONE safetensors file, ``<checkpoint_dir>/<job>/step-<step>[.<tag>].safetensors``, of
format :data:`JOB_STATE_FORMAT`, written by :func:`save_state` for every job (an entrypoint's
function and the built-in loop both checkpoint through the job API, :mod:`.jobapi`):

- tensors ``user.<n>`` (the tensors of the job's state, :func:`libbus.jobapi.encode_state`: the
  built-in loop's is ``{"model": ..., "optimizer": ...}``), ``rng.torch``, ``rng.cuda.<i>`` and
  ``rng.numpy`` (the random generators' states);
- string metadata, all JSON: ``batchbus`` (the format), ``step``, ``epoch``, ``state`` (the state's
  skeleton: where each tensor sits), ``cursors`` (every loader's position by name,
  :meth:`libbus.loader.remote.RemoteLoader.state_dict`), ``cursor`` (the train loader's, for the
  router's record), ``rng`` (python's and numpy's non-array parts) and ``extra`` (history, running
  loss).

Nothing is pickled, so loading a checkpoint cannot run code. A file is written to a temporary name
in the same directory, fsynced, renamed into place and the directory fsynced: a crash leaves the old
checkpoint or the new one, never half of one. Its sha256 goes to the router with the record, and is
checked before the file is trusted again (:func:`read_state`, which also reads the built-in loop's
files of before, :data:`FORMAT`). The trainer keeps the last :data:`KEEP` per job, and those the
router may hold (:func:`prune`). :func:`checkpoint_model` takes the model weights alone out of one (a job
that starts from another job's current weights, ``model_from``).

The final model is ``<checkpoint_dir>/<job>/model.safetensors``: the plain state dict, loadable with
``safetensors.torch.load_file`` into the model the job names.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import orjson
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

from libbus.errors import BusError
from libbus.jobapi import CheckpointRecord, ModelRecord, StateError, decode_state, encode_state
from libbus.jobs.spec import JobSpec
from services.atomic import write_atomic

from ..attempt_user import job_folder

__all__ = [
    "FORMAT",
    "JOB_STATE_FORMAT",
    "KEEP",
    "CheckpointError",
    "Restored",
    "checkpoint_model",
    "job_dir",
    "load_state",
    "model_metadata",
    "prune",
    "read_checkpoint",
    "read_state",
    "save_model",
    "save_state",
    "set_rng_state",
]

#: The format the built-in loop wrote before it ran on the job API (read, never written).
FORMAT = "batchbus-checkpoint-1"
#: The format of every job's checkpoint (:func:`save_state`).
JOB_STATE_FORMAT = "batchbus-job-state-1"
#: Checkpoints a trainer keeps per job (older ones are removed once a newer one is on disk).
KEEP = 2


class CheckpointError(BusError):
    """A checkpoint that cannot be written or trusted (missing, wrong sha256, not ours)."""


@dataclass
class Restored:
    """What a checkpoint holds (:func:`read_state`)."""

    #: The job's state, as given to ``job.checkpoint`` (objects with a ``state_dict()`` as that dict).
    state: Any
    step: int
    epoch: int
    #: Every loader's cursor, by loader name (``train``: the job's train loader).
    cursors: dict
    #: The history and running train loss the job resumes with.
    extra: dict
    #: The random generators' state (:func:`set_rng_state` puts it back).
    rng: tuple[dict[str, torch.Tensor], dict]


#: Where a job's checkpoints and final model are written (lent to ``attempt_user`` while its attempt runs).
job_dir = job_folder


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous()


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = state
    # the global generator is MT19937, whose legacy state is this tuple (the stubs allow a dict too)
    legacy = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state(legacy=True))
    name, keys, pos, has_gauss, cached = legacy
    tensors["rng.numpy"] = torch.from_numpy(keys.astype(np.int64))
    meta = {"python": random.getstate(), "numpy": [name, int(pos), int(has_gauss), float(cached)]}
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("rng.cuda."))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    version, state, gauss = meta["python"]
    random.setstate((version, tuple(state), gauss))
    name, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((name, tensors["rng.numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))


def save_state(
    directory: Path,
    *,
    step: int,
    epoch: int,
    state: Any,
    cursors: Mapping[str, dict],
    extra: dict,
    tag: str = "",
) -> CheckpointRecord:
    """Write a job's checkpoint (format :data:`JOB_STATE_FORMAT`, the module docstring): its
    ``state`` (:func:`libbus.jobapi.encode_state`: tensors and plain data), every loader's cursor by
    name, the random generators, ``step``, ``epoch`` and ``extra`` (history, running loss). Returns
    its record for the router (path, sha256, step, epoch, the train loader's cursor, bytes).

    ``tag`` tells apart files of one step (``e``: the one after an epoch's validation, taken at the
    same step as one after its last batch): the record the router holds always names intact bytes."""
    tensors, skeleton = encode_state(state)
    rng_tensors, rng_meta = rng_state()
    cursor = dict(cursors.get("train", {}))
    metadata = {
        "batchbus": JOB_STATE_FORMAT,
        "step": str(step),
        "epoch": str(epoch),
        "cursor": orjson.dumps(cursor).decode(),
        "cursors": orjson.dumps(dict(cursors)).decode(),
        "state": orjson.dumps(skeleton).decode(),
        "rng": orjson.dumps(rng_meta).decode(),
        "extra": orjson.dumps(extra).decode(),
    }
    data = save_safetensors({**{f"user.{k}": v for k, v in tensors.items()}, **rng_tensors}, metadata=metadata)
    path = directory / f"step-{step:09d}{'.' + tag if tag else ''}.safetensors"
    digest = write_file(path, data)
    return {"path": str(path), "sha256": digest, "step": step, "epoch": epoch, "cursor": cursor, "bytes": len(data)}


def _step_of(path: Path) -> tuple[int, bool]:
    step, _, tag = path.stem.removeprefix("step-").partition(".")
    return int(step), tag == "e"


def prune(directory: Path, held: Collection[int | None]) -> list[Path]:
    """Remove all but the last :data:`KEEP` checkpoints and those of the steps the router may hold
    (``held``, :meth:`.reports.Reporter.held_steps`): the last record it acknowledged, and the one
    sent to it and not answered yet. The job resumes from one of those if this trainer dies now:
    while reports wait for an absent router, or when the trainer dies between the router's record
    and its answer (its attempt may still write a checkpoint or two before it dies with it). The
    newer ones the router has not heard of are of no use past the last ``KEEP``, once their records
    are sent. An attempt calls it through :meth:`.reports.Reporter.prune_checkpoints`, which holds
    the records still waiting to be sent too: so a trainer holds ``KEEP + 2`` steps' files per job,
    and while the router is away, one more for each record that waits for it. Returns what was
    removed."""
    files = sorted(directory.glob("step-*.safetensors"), key=_step_of)
    removed = []
    for path in files[:-KEEP]:
        step, _ = _step_of(path)
        if step in held:
            continue
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def load_state(record: dict, root: str) -> Restored:
    """The checkpoint ``record`` names, read from under ``root`` (:func:`read_checkpoint`) and
    checked (:func:`read_state`)."""
    return read_state(read_checkpoint(record, root), record)


def read_checkpoint(record: Mapping[str, Any], root: str) -> bytes:
    """The bytes of the checkpoint ``record`` names, from under ``root`` (see :func:`load_checkpoint`;
    a gang's rank 0 sends them to its other ranks). :func:`restore_checkpoint` checks them."""
    path = Path(str(record.get("path", "")))
    if not path.resolve().is_relative_to(Path(root).resolve()):
        raise CheckpointError(f"checkpoint {path} is not under this trainer's checkpoint_dir {root}")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CheckpointError(
            f"checkpoint {path} cannot be read here: {err.strerror} (is checkpoint_dir shared between trainers?)"
        ) from err
    return data


def metadata_of(data: bytes) -> dict:
    """A safetensors blob's string metadata (its header is 8 bytes of length, then JSON)."""
    size = int.from_bytes(data[:8], "little")
    return orjson.loads(data[8 : 8 + size]).get("__metadata__") or {}


def check_digest(data: bytes, record: Mapping[str, Any]) -> str:
    """``record``'s path, once ``data`` is checked against the sha256 the router recorded for it.

    Raises:
        CheckpointError: the bytes differ (changed or truncated since they were written).
    """
    path = str(record.get("path"))
    digest = hashlib.sha256(data).hexdigest()
    if digest != record.get("sha256"):
        raise CheckpointError(
            f"checkpoint {path} has sha256 {digest[:12]}…, the router recorded "
            f"{str(record.get('sha256'))[:12]}…: changed or truncated since it was written"
        )
    return path


def read_state(data: bytes, record: Mapping[str, Any]) -> Restored:
    """What checkpoint bytes ``data`` (read here, or received from a gang's rank 0) hold, once
    checked against ``record``'s sha256: a job's state (:data:`JOB_STATE_FORMAT`), or a checkpoint
    the built-in loop wrote before it ran on the job API (:data:`FORMAT`: its model and optimizer
    become the state ``{"model", "optimizer"}`` the built-in loop restores, its cursor the train
    loader's), so a job resumes exactly across that upgrade. Nothing in it is unpickled.

    Raises:
        CheckpointError: the bytes changed since the router recorded them, are not a batchbus
            checkpoint, or do not decode.
    """
    path = check_digest(data, record)
    try:
        tensors = load_safetensors(data)
        meta = metadata_of(data)
        kind = meta.get("batchbus")
        if kind == JOB_STATE_FORMAT:
            user = {k.removeprefix("user."): v for k, v in tensors.items() if k.startswith("user.")}
            state = decode_state(user, orjson.loads(meta["state"]))
            cursors = orjson.loads(meta["cursors"])
        elif kind == FORMAT:
            state, cursors = _built_in_state(tensors, meta), {"train": orjson.loads(meta["cursor"])}
        else:
            raise CheckpointError(f"{path} is not a batchbus checkpoint (format {kind!r})")
        return Restored(
            state=state,
            step=int(meta["step"]),
            epoch=int(meta.get("epoch", 0)),
            cursors=cursors if isinstance(cursors, dict) else {},
            extra=orjson.loads(meta["extra"]),
            rng=({k: v for k, v in tensors.items() if k.startswith("rng.")}, orjson.loads(meta["rng"])),
        )
    except (SafetensorError, StateError, ValueError, KeyError, AttributeError, orjson.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint {path} cannot be read: {err}") from err


def _built_in_state(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    """A :data:`FORMAT` checkpoint's model and optimizer as state dicts."""
    optim = orjson.loads(meta["optim"])
    opt_state: dict = {int(p): dict(v) for p, v in optim["state"].items()}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, param, name = key.split(".", 2)
            opt_state.setdefault(int(param), {})[name] = value
    model = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    return {"model": model, "optimizer": {"state": opt_state, "param_groups": optim["param_groups"]}}


def checkpoint_model(data: bytes, record: dict) -> dict[str, torch.Tensor]:
    """The model weights alone in checkpoint bytes ``data`` (another job's, named by ``record``),
    checked against ``record``'s sha256 first (:func:`read_state`): the ``model`` entry of the job's
    state (a module's or a plain state dict, as ``job.checkpoint`` stored it; the built-in loop's
    model). Its optimizer, cursors, step and random state are left out.

    Raises:
        CheckpointError: the bytes changed since the router recorded them, are not a batchbus
            checkpoint, or hold no model weights.
    """
    path = str(record.get("path"))
    state = read_state(data, record).state
    model = state.get("model") if isinstance(state, Mapping) else None
    if not isinstance(model, Mapping) or not model or not all(isinstance(v, torch.Tensor) for v in model.values()):
        raise CheckpointError(
            f"checkpoint {path} holds no model weights: its job's state (job.checkpoint / job.on_checkpoint) "
            "needs a 'model' entry, a module or a state dict of tensors"
        )
    return {str(k): v for k, v in model.items()}


def model_metadata(job: str, spec: JobSpec, step: int) -> dict[str, str]:
    """The safetensors metadata of a job's model: enough to build it again (``model`` and its
    ``model_kwargs``) and to say where it is from (``job``, ``step``)."""
    return {
        "job": job,
        "model": spec.model,
        "step": str(step),
        "model_kwargs": orjson.dumps(spec.model_kwargs).decode(),
    }


def save_model(directory: Path, model: nn.Module | Mapping[str, torch.Tensor], metadata: dict[str, str]) -> ModelRecord:
    """Write the final weights (a model, or its state dict) as ``model.safetensors``; returns
    ``{path, sha256, bytes}``. Tensors sharing memory (tied weights) are stored each whole."""
    state = model.state_dict() if isinstance(model, nn.Module) else model
    tensors: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"model weights: {key!r} is a {type(value).__name__}, not a tensor")
        tensors[str(key)] = _cpu(value)
    data = save_safetensors(_unshared(tensors), metadata=metadata)
    path = directory / "model.safetensors"
    return {"path": str(path), "sha256": write_file(path, data), "bytes": len(data)}


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every one that shares memory with an earlier one (or is a part of a larger
    storage) copied: safetensors stores whole, unshared tensors only."""
    seen: set[int] = set()
    out = {}
    for key, t in tensors.items():
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or t.nbytes != storage.nbytes():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[key] = t
    return out


def write_file(path: Path, data: bytes) -> str:
    try:
        return write_atomic(path, data)
    except OSError as err:
        raise CheckpointError(
            f"cannot write {path}: {err.strerror or err} (checkpoint_dir full or not writable?)"
        ) from err
