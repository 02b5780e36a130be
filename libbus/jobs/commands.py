"""What can be done to a running job: the one list of job commands, shared by the CLI (``busctl job …``),
the router (which checks an admin's ``ControlJob`` and pushes a ``Command``) and the trainer (which applies
it between batches and acknowledges it with a ``CommandAck``).

On the wire a command is its value (``ControlJob.command``, ``Command.command``, ``CommandAck.command``);
everywhere else it is a :class:`JobCommand`, so that a command one side knows and the other does not is a
name error, not a string that silently matches nothing.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["ADMIN_COMMANDS", "JobCommand"]


class JobCommand(StrEnum):
    """A command to a job. A ``str`` enum: sent and compared as its value."""

    #: End the job; a running one checkpoints first (``resume`` queues it again).
    STOP = "stop"
    #: Train on no more batches; the trainer keeps the job and its lease.
    PAUSE = "pause"
    #: Continue a paused job, or queue a stopped or failed one again from its last checkpoint.
    RESUME = "resume"
    #: Write a checkpoint now; acknowledged with its record.
    CHECKPOINT = "checkpoint"
    #: Change hyper-parameters (``args``: the values, names from ``libbus.jobs.spec.SETTABLE``).
    SET = "set"
    #: Score the current weights on the provider's test split; acknowledged with the scores.
    EVAL = "eval"
    #: Load another job's checkpoint (``args``: ``{checkpoint, from}``; population-based training).
    ADOPT = "adopt"
    #: Send the current weights (``busctl job model --current``).
    MODEL = "model"
    #: The trainer's own, never on the wire: it is shutting down and hands the job back.
    SHUTDOWN = "shutdown"

    def __str__(self) -> str:
        return self.value

    @property
    def takes_args(self) -> bool:
        """Whether the command carries ``args`` (the others refuse any)."""
        return self in (JobCommand.SET, JobCommand.ADOPT)

    @property
    def slow(self) -> bool:
        """Acknowledged only after slow work (weights copied and scored or sent), so it waits longer."""
        return self in (JobCommand.EVAL, JobCommand.MODEL)


#: The commands an admin (or the router's own studies and early stopping) may send: all but SHUTDOWN.
ADMIN_COMMANDS: tuple[JobCommand, ...] = tuple(c for c in JobCommand if c is not JobCommand.SHUTDOWN)
