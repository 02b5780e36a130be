"""Messages of jobs (submission, tasks, progress, results, models, commands to trainers) and of
studies. Each is declared with :func:`~libbus.wire.frames.message` (which registers it) and, when it is a
request, names its reply as its base; import them from :mod:`libbus.wire.messages`.
"""

from __future__ import annotations

from dataclasses import field
from typing import ClassVar

from libbus.wire.frames import Message, Request, message
from libbus.wire.msg_session import Ok

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
    "RenewGrant",
    "Grant",
    "Rendezvous",
    "NoTask",
    "Progress",
    "JobLog",
    "GetJobLogs",
    "JobLogs",
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
    "GetJobSamples",
    "JobSamples",
    "SkipJob",
]


# -- jobs ---------------------------------------------------------------------------------------


@message
class SubmitJob(Request["JobSubmitted"]):
    """A job spec; an ``evaluate`` task of an uploaded model carries it as one payload frame
    (safetensors bytes), which the router keeps as ``artifact:ID``."""

    nframes: ClassVar[tuple[int, int]] = (0, 1)
    spec: dict


@message
class JobSubmitted(Message):
    job: str
    #: What the router could not check (a module no connected trainer listed); "" when all was.
    note: str = ""


@message
class ListJobs(Request["JobList"]):
    """Jobs, newest first: ``limit`` of them after the ``offset`` newest (pages)."""

    state: str | None = None
    limit: int = 100
    offset: int = 0


@message
class JobList(Message):
    jobs: list
    #: Set when the list was cut to fit one reply: what was left out and how to see it.
    note: str = ""


@message
class GetJob(Request["JobInfo"]):
    """One job; with ``progress`` > 0 also its last ``progress`` progress reports; ``events``
    events and checkpoint records, newest first after skipping ``offset`` of them (pages)."""

    job: str
    progress: int = 0
    events: int = 200
    offset: int = 0


@message
class JobInfo(Message):
    job: dict
    #: Set when history was cut to fit one reply.
    note: str = ""


@message
class ControlJob(Request["Ok | Model"]):
    """Admin → router: ``command`` (a :class:`libbus.jobs.commands.JobCommand` value: stop, pause, resume,
    checkpoint, set, eval, adopt, model) for ``job``; ``args`` for set (the hyper-parameters to change)
    and adopt (the checkpoint to load)."""

    job: str
    command: str
    args: dict = field(default_factory=dict)


@message
class GetTask(Request["Task | NoTask"]):
    """Trainer → router: give me work. ``key`` names this one ask: the same ``key`` again (the
    link resends after a reconnect, the trainer asks again after a lost reply) gets the job it
    was already given, at no cost of an attempt."""

    key: str = ""


@message
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
    #: Attempts of this job begun before this one (0 on its first).
    attempt: int = 0
    #: A training job whose ``model_from`` names a job that has not succeeded: that job's latest
    #: checkpoint record (``{path, sha256, step, ...}``) when this task was handed out; a first
    #: attempt starts from the model weights in that file (read from the shared ``checkpoint_dir``).
    initial: dict | None = None
    #: The attempt's grant: a short-lived ``attempt`` token scoped to this job and its dataset, which
    #: the attempt's process reads and evaluates with instead of its trainer's token ("" from a router
    #: that cannot mint: it holds no signing key).
    grant: str = ""


@message
class RenewGrant(Request["Grant"]):
    """Trainer → router, for the attempt it runs: a fresh grant for ``job``, which this trainer
    must still hold (answered with :class:`Grant`)."""

    job: str


@message
class Grant(Message):
    """A fresh ``attempt`` token for the job a :class:`RenewGrant` named."""

    token: str


@message
class Rendezvous(Request[Ok]):
    """Trainer (rank 0 of a gang) → router: where the other ranks meet it (``tcp://host:port``,
    a torch.distributed TCPStore). Answered with ``Ok``."""

    job: str
    address: str


@message
class NoTask(Message):
    retry_ms: int


@message
class JobLog(Request[Ok]):
    """Trainer → router: lines an entrypoint job's attempt printed (stdout and stderr, in order;
    ``seq`` is the first line's number in the attempt), kept for ``busctl job logs``."""

    job: str
    attempt: int
    seq: int
    lines: list


@message
class GetJobLogs(Request["JobLogs"]):
    """Admin → router: the output lines of one attempt of ``job`` (``attempt`` -1: the latest) from
    line ``after`` on, at most ``limit``."""

    job: str
    attempt: int = -1
    after: int = 0
    limit: int = 1000


@message
class JobLogs(Message):
    """The lines asked for; ``next`` is the ``after`` to ask with for the ones after them; ``dropped``
    counts the attempt's earliest lines no longer kept; ``attempts`` lists those the router keeps."""

    job: str
    attempt: int
    lines: list
    next: int
    dropped: int = 0
    attempts: list = field(default_factory=list)


@message
class Progress(Request[Ok]):
    job: str
    progress: dict


@message
class PushResult(Request[Ok]):
    """A job's end (or hand-back). A succeeded job's final weights may ride along as one payload
    frame (safetensors bytes, sha256 in ``result.model``) for the router to keep."""

    nframes: ClassVar[tuple[int, int]] = (0, 1)
    job: str
    state: str
    result: dict = field(default_factory=dict)
    error: str = ""


@message
class GetModel(Request["Model"]):
    """Admin → router: the final weights of a succeeded job."""

    job: str


@message
class Model(Message):
    """The weights as one payload frame (safetensors bytes) and their sha256; ``step`` and ``epoch``
    of a running job's current weights (``busctl job model --current``), 0 for a final model."""

    nframes: ClassVar[tuple[int, int]] = (1, 1)
    job: str
    sha256: str
    nbytes: int
    step: int = 0
    epoch: int = 0


@message
class Command(Message):
    """Router → trainer, unsolicited (``id`` 0): a :class:`libbus.jobs.commands.JobCommand` value.
    The trainer answers a non-zero ``seq`` with :class:`CommandAck` once it has applied it."""

    job: str
    command: str
    args: dict = field(default_factory=dict)
    seq: int = 0


@message
class CommandAck(Request[Ok]):
    """Trainer → router: command ``seq`` of ``job`` was applied; ``state`` is the job's state on the
    trainer now (running or paused); ``detail`` says what was done (a checkpoint's record...).
    ``model`` (``busctl job model --current``) carries the copied weights as one payload frame."""

    nframes: ClassVar[tuple[int, int]] = (0, 1)
    job: str
    command: str
    seq: int
    state: str
    detail: dict = field(default_factory=dict)


@message
class Checkpointed(Request[Ok]):
    """Trainer → router: a checkpoint of ``job`` is on disk (``checkpoint``: path, sha256, step,
    epoch, cursor); the job resumes from the latest one if its trainer is lost."""

    job: str
    checkpoint: dict


# -- studies (services/router/studies.py) ------------------------------------------------------


@message
class SubmitStudy(Request["StudyInfo"]):
    """Admin → router: a study file's tables (``{base, space, study}``). Reply: :class:`StudyInfo`."""

    spec: dict


@message
class ListStudies(Request["StudyList"]):
    pass


@message
class GetStudy(Request["StudyInfo"]):
    study: str


@message
class StopStudy(Request[Ok]):
    """Admin → router: stop a study and its running trials. Reply: ``Ok``."""

    study: str


@message
class StudyInfo(Message):
    """A study: ``{id, state, objective, direction, trials: [{number, job, params, state, value,
    epochs, reports}], best, epochs_trained, epochs_budget, spec}``."""

    study: dict


@message
class StudyList(Message):
    studies: list


# -- which samples made a step, and skipping a stretch (libbus/order/history.py; docs/jobs.md) ----


@message
class GetJobSamples(Request["JobSamples"]):
    """Admin → router: the sample indices of ``step`` (of every rank, or of ``rank`` >= 0), or, with
    ``epoch`` >= 0, of positions ``start..stop`` of that epoch's whole order."""

    job: str
    step: int = 0
    rank: int = -1
    epoch: int = -1
    start: int = 0
    stop: int = 0


@message
class JobSamples(Message):
    """``samples``: ``[{rank, world_size, epoch, position, indices}]`` for a step, or one entry
    ``{epoch, start, stop, indices}`` for a range; ``n``: the samples the job's order is over."""

    job: str
    samples: list
    n: int = 0
    note: str = ""


@message
class SkipJob(Request[Ok]):
    """Admin → router: never train ``job`` on these samples again: the samples of ``steps``
    (``[[a, b], ...]``, steps ``a <= k < b``) and ``samples`` (index ranges ``[a, b)``). The job
    rewinds to its last checkpoint before the first skipped step. Reply: ``Ok`` with what was skipped.
    Trainer → router, with ``spike`` (``{step, loss, median, window}``): the job's trainer skips the
    stretch of a loss spike (the job's ``spike`` option), recorded in its spec's ``spikes``."""

    job: str
    steps: list = field(default_factory=list)
    samples: list = field(default_factory=list)
    spike: dict = field(default_factory=dict)
