"""Messages of jobs (submission, tasks, progress, results, models, commands to trainers) and of
studies. Each class registers itself with :mod:`libbus.wire.frames` when this module is imported; import them
from :mod:`libbus.wire.messages`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from libbus.wire.frames import Message

__all__ = [
    "SubmitJob",
    "JobSubmitted",
    "ListJobs",
    "JobList",
    "GetJob",
    "JobInfo",
    "ControlJob",
    "GetTask",
    "Task",
    "Rendezvous",
    "NoTask",
    "Progress",
    "PushResult",
    "Command",
    "CommandAck",
    "Checkpointed",
    "GetModel",
    "Model",
    "SubmitStudy",
    "ListStudies",
    "GetStudy",
    "StopStudy",
    "StudyInfo",
    "StudyList",
]


# -- jobs ---------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class SubmitJob(Message):
    """A job spec; an ``evaluate`` task of an uploaded model carries it as one payload frame
    (safetensors bytes), which the router keeps as ``artifact:ID``."""

    nframes: ClassVar[tuple[int, int]] = (0, 1)
    spec: dict


@dataclass(kw_only=True)
class JobSubmitted(Message):
    job: str


@dataclass(kw_only=True)
class ListJobs(Message):
    """Jobs, newest first: ``limit`` of them after the ``offset`` newest (pages)."""

    state: str | None = None
    limit: int = 100
    offset: int = 0


@dataclass(kw_only=True)
class JobList(Message):
    jobs: list
    #: Set when the list was cut to fit one reply: what was left out and how to see it.
    note: str = ""


@dataclass(kw_only=True)
class GetJob(Message):
    """One job; with ``progress`` > 0 also its last ``progress`` progress reports; ``events``
    events and checkpoint records, newest first after skipping ``offset`` of them (pages)."""

    job: str
    progress: int = 0
    events: int = 200
    offset: int = 0


@dataclass(kw_only=True)
class JobInfo(Message):
    job: dict
    #: Set when history was cut to fit one reply.
    note: str = ""


@dataclass(kw_only=True)
class ControlJob(Message):
    """Admin → router: ``command`` (a :class:`libbus.jobs.commands.JobCommand` value: stop, pause, resume,
    checkpoint, set, eval, adopt, model) for ``job``; ``args`` for set (the hyper-parameters to change)
    and adopt (the checkpoint to load)."""

    job: str
    command: str
    args: dict = field(default_factory=dict)


@dataclass(kw_only=True)
class GetTask(Message):
    """Trainer → router: give me work. ``key`` names this one ask: the same ``key`` again (the
    link resends after a reconnect, the trainer asks again after a lost reply) gets the job it
    was already given, at no cost of an attempt."""

    key: str = ""


@dataclass(kw_only=True)
class Task(Message):
    """A job for the trainer that asked. In a gang (``world_size`` > 1) every rank gets one;
    ranks above 0 get theirs once rank 0 has reported ``rendezvous`` (``tcp://host:port``).
    An ``evaluate`` task carries the model to score as one payload frame (safetensors bytes)."""

    nframes: ClassVar[tuple[int, int]] = (0, 1)
    job: str
    spec: dict
    rank: int = 0
    world_size: int = 1
    resume: dict | None = None
    rendezvous: str = ""


@dataclass(kw_only=True)
class Rendezvous(Message):
    """Trainer (rank 0 of a gang) → router: where the other ranks meet it (``tcp://host:port``,
    a torch.distributed TCPStore). Answered with ``Ok``."""

    job: str
    address: str


@dataclass(kw_only=True)
class NoTask(Message):
    retry_ms: int


@dataclass(kw_only=True)
class Progress(Message):
    job: str
    progress: dict


@dataclass(kw_only=True)
class PushResult(Message):
    """A job's end (or hand-back). A succeeded job's final weights may ride along as one payload
    frame (safetensors bytes, sha256 in ``result.model``) for the router to keep."""

    nframes: ClassVar[tuple[int, int]] = (0, 1)
    job: str
    state: str
    result: dict = field(default_factory=dict)
    error: str = ""


@dataclass(kw_only=True)
class GetModel(Message):
    """Admin → router: the final weights of a succeeded job."""

    job: str


@dataclass(kw_only=True)
class Model(Message):
    """The weights as one payload frame (safetensors bytes) and their sha256; ``step`` and ``epoch``
    of a running job's current weights (``busctl job model --current``), 0 for a final model."""

    nframes: ClassVar[tuple[int, int]] = (1, 1)
    job: str
    sha256: str
    nbytes: int
    step: int = 0
    epoch: int = 0


@dataclass(kw_only=True)
class Command(Message):
    """Router → trainer, unsolicited (``id`` 0): a :class:`libbus.jobs.commands.JobCommand` value.
    The trainer answers a non-zero ``seq`` with :class:`CommandAck` once it has applied it."""

    job: str
    command: str
    args: dict = field(default_factory=dict)
    seq: int = 0


@dataclass(kw_only=True)
class CommandAck(Message):
    """Trainer → router: command ``seq`` of ``job`` was applied; ``state`` is the job's state on the
    trainer now (running or paused); ``detail`` says what was done (a checkpoint's record...).
    ``model`` (``busctl job model --current``) carries the copied weights as one payload frame."""

    nframes: ClassVar[tuple[int, int]] = (0, 1)
    job: str
    command: str
    seq: int
    state: str
    detail: dict = field(default_factory=dict)


@dataclass(kw_only=True)
class Checkpointed(Message):
    """Trainer → router: a checkpoint of ``job`` is on disk (``checkpoint``: path, sha256, step,
    epoch, cursor); the job resumes from the latest one if its trainer is lost."""

    job: str
    checkpoint: dict


# -- studies (services/router/studies.py) ------------------------------------------------------


@dataclass(kw_only=True)
class SubmitStudy(Message):
    """Admin → router: a study file's tables (``{base, space, study}``). Reply: :class:`StudyInfo`."""

    spec: dict


@dataclass(kw_only=True)
class ListStudies(Message):
    pass


@dataclass(kw_only=True)
class GetStudy(Message):
    study: str


@dataclass(kw_only=True)
class StopStudy(Message):
    """Admin → router: stop a study and its running trials. Reply: ``Ok``."""

    study: str


@dataclass(kw_only=True)
class StudyInfo(Message):
    """A study: ``{id, state, objective, direction, trials: [{number, job, params, state, value,
    epochs, reports}], best, epochs_trained, epochs_budget, spec}``."""

    study: dict


@dataclass(kw_only=True)
class StudyList(Message):
    studies: list
