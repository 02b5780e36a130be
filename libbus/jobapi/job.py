"""The object a job's training function is handed: its parameters, its loaders, its checkpoints,
its reports, its model. The trainer provides it (``services/trainer/attempt/jobapi.py``); this is its
contract. Commands (pause, resume, checkpoint, set, stop) are applied at the calls below, where the
function has finished a step, so a checkpoint taken there resumes at the exact next sample.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, TypedDict

import torch

__all__ = ["CheckpointRecord", "Job", "JobEnded", "ModelRecord"]


class CheckpointRecord(TypedDict, total=False):
    """A checkpoint as :meth:`Job.checkpoint` returns it and the router keeps it: its file, the file's
    sha256 and bytes, the step and epoch it resumes at, and the train loader's cursor. Empty (``{}``) on
    a rank other than 0 before rank 0's first checkpoint: rank 0 checkpoints for the gang."""

    path: str
    sha256: str
    step: int
    epoch: int
    cursor: dict[str, Any]
    bytes: int


class ModelRecord(TypedDict):
    """The job's model as :meth:`Job.save_model` returns it: its file, sha256 and bytes."""

    path: str
    sha256: str
    bytes: int


class JobEnded(BaseException):
    """The job ends at this call: stopped (``busctl job stop``), pruned by its study, stopped early,
    or handed back because the trainer is shutting down (``handback``). The job's state was
    checkpointed first where a state is known. It derives from ``BaseException`` like
    ``KeyboardInterrupt``, so an ``except Exception`` in the function does not swallow it: let it
    propagate (a ``finally`` still runs)."""

    def __init__(self, why: str, *, handback: bool = False):
        super().__init__(why)
        self.why = why
        self.handback = handback


class Job(ABC):
    """One attempt of a job, as its training function sees it.

    Attributes:
        id: the job's id (``busctl job show ID``).
        rank, world_size: this trainer's place in the job's gang (0 and 1 alone).
        attempt: how many attempts of this job came before this one (0 on the first).
        device: the job's ``device`` (``cpu``, ``cuda``, ``cuda:1``) as a ``torch.device``.
        step_count: steps made so far (:meth:`step` calls), counted over every attempt.
        epochs_reported: :meth:`report` calls so far, over every attempt.
        history: the records :meth:`report` made, oldest first, over every attempt.
    """

    id: str
    rank: int
    world_size: int
    attempt: int
    device: torch.device
    step_count: int
    epochs_reported: int
    history: list[dict]

    @property
    @abstractmethod
    def params(self) -> Mapping[str, Any]:
        """The job's ``params``, with the changes ``busctl job set`` made (seen from the next
        :meth:`step` or :meth:`report` on). Read it where the value is used, each time."""

    @abstractmethod
    def loader(self, split: str = "train", **kwargs: Any) -> Any:
        """A :class:`~libbus.loader.remote.RemoteLoader` over the job's dataset: ``train`` in the
        job's order (``shuffle``, ``seed``, ``block_size`` of the job) sharded to this rank; ``val``
        in file order, whole, unless ``kwargs`` say otherwise. ``batch_size`` defaults to the job's.
        A resumed attempt's loader starts at the cursor stored with the state :meth:`restore`
        returns. One loader per split (``name=`` tells several apart)."""

    @abstractmethod
    def restore(self) -> dict | None:
        """The state last given to :meth:`checkpoint` by an earlier attempt (tensors as tensors,
        models and optimizers as their state dicts), or ``None`` on a first attempt (or when that
        checkpoint cannot be read on this trainer: the job starts over, said in its events). Also
        puts the random generators back, and the loaders at their stored cursors."""

    @abstractmethod
    def initial_model(self) -> dict[str, torch.Tensor] | None:
        """The weights the job starts from when it names ``model_from`` (a succeeded job's model,
        the model weights of the latest checkpoint of a job that has not succeeded, or a file
        uploaded with it: ``busctl submit --model-from``), as a state dict; ``None`` without. Load
        them on a first attempt (``restore()`` returned ``None``). In a gang, call it on every rank:
        rank 0 reads a checkpoint and shares it, so every rank gets the same snapshot."""

    @abstractmethod
    def checkpoint(self, state: Mapping[str, Any] | None = None) -> CheckpointRecord:
        """Store ``state`` (or what :meth:`on_checkpoint`'s function returns) with every loader's
        cursor, the random generators' state, the step count and the history, in one file written
        atomically; returns its record. A resumed attempt continues right after this call."""

    @abstractmethod
    def on_checkpoint(self, get_state: Callable[[], Mapping[str, Any]]) -> None:
        """How to get the state when the trainer checkpoints on its own: every ``checkpoint_every``
        steps, at each :meth:`report`, when an operator asks (``busctl job checkpoint``), and before
        a stop or a hand-back. Without it those checkpoints are not taken (a stop resumes from your
        last :meth:`checkpoint`)."""

    @abstractmethod
    def step(self, samples: int | None = None, **metrics: float) -> None:
        """One training step is done (``loss=`` is averaged into the progress the router shows,
        weighted by ``samples``: the step's batch size, the train loader's unless given, e.g. for a
        smaller last batch). Commands apply here: a pause waits here, a stop ends the function here
        (:class:`JobEnded`)."""

    @abstractmethod
    def report(self, **metrics: float) -> None:
        """One epoch's (or evaluation round's) metrics: a record in the job's history, what
        ``busctl job watch``, studies and early stopping read (``val_loss``, ``val_accuracy`` by
        default). The router's verdict on it (prune, stop early) applies here, deterministically."""

    @abstractmethod
    def save_model(self, state_dict: Mapping[str, torch.Tensor]) -> ModelRecord:
        """The job's model: the weights ``busctl job model`` returns and the provider scores on its
        private test split. Returns its record (path, bytes, sha256)."""
