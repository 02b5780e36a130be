"""The router's commands to a running task (:class:`~libbus.jobs.commands.JobCommand`: stop, pause,
resume, checkpoint, set, eval, adopt, model; and the trainer's own shutdown), applied between batches and
acknowledged (``eval`` once its evaluation is done: :mod:`.evaluation`).

:meth:`Controls.check` is called by the training loop only where the loader's position equals the
samples trained on, so a checkpoint taken on command (or on stop) resumes at the exact next sample.
A command may arrive twice (pushed, and repeated in a progress reply until acknowledged): each
``seq`` is applied once.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from functools import partial

from libbus.errors import BadRequest
from libbus.jobs.commands import JobCommand
from libbus.jobs.state import JobState
from libbus.wire.messages import Command, CommandAck

from ..reports import Reporter

__all__ = ["Controls", "Lost", "Stopped"]

log = logging.getLogger(__name__)

#: How often a paused task looks for commands (and reports progress, if due).
PAUSED_POLL_S = 0.1


class Stopped(Exception):
    """The task ends before its last epoch: stopped by the router, or (``handback``) given back
    because the trainer is shutting down."""

    def __init__(self, handback: bool = False):
        super().__init__("handed back" if handback else "stopped")
        self.handback = handback


class Lost(Exception):
    """The router gave the job to another trainer (this one's lease lapsed): abandon it quietly."""


class Controls:
    """Applies one task's commands.

    Args:
        job: the task's job.
        commands: where the trainer's link puts pushed commands (and the reporter repeated ones).
        reporter: sends acknowledgements; tells of a stop whose push was lost, or a lost job.
        checkpoint: writes a checkpoint now (or returns the one of this very step); returns its record.
        set_hyper: applies ``set`` arguments; returns the new spec (raises :class:`BadRequest`).
        report: sends a progress report if one is due (also while paused: its replies carry commands).
        before_stop: called before :class:`Stopped` is raised (the task's last checkpoint).
        evaluate: copies the weights now and scores them in the background; calls its argument
            with the result (``busctl job eval``).
        adopt: loads another job's checkpoint (weights and optimizer state; population-based
            training); returns what it loaded (raises :class:`BadRequest`).
        model: copies the current weights; returns ``(detail, safetensors bytes)`` (``busctl job
            model --current``).
    """

    def __init__(
        self,
        job: str,
        commands: queue.Queue[Command],
        reporter: Reporter,
        *,
        checkpoint: Callable[[], dict],
        set_hyper: Callable[[dict], dict],
        report: Callable[[], None],
        before_stop: Callable[[], None],
        evaluate: Callable[[Callable[[dict], None]], None],
        adopt: Callable[[dict], dict] | None = None,
        model: Callable[[], tuple[dict, bytes]] | None = None,
    ):
        self.job = job
        self.commands = commands
        self.reporter = reporter
        self._checkpoint = checkpoint
        self._set_hyper = set_hyper
        self._report = report
        self._before_stop = before_stop
        self._evaluate = evaluate
        #: ``running`` or ``paused``.
        self.state = JobState.RUNNING
        self._applied: set[int] = set()
        #: What each command does here (``adopt`` and ``model`` only where the run can).
        self._appliers: dict[JobCommand, Callable[[Command], None]] = {
            JobCommand.STOP: self._on_stop,
            JobCommand.SHUTDOWN: self._on_stop,
            JobCommand.PAUSE: self._on_pause,
            JobCommand.RESUME: self._on_resume,
            JobCommand.CHECKPOINT: self._on_checkpoint,
            JobCommand.SET: self._on_set,
            JobCommand.EVAL: self._on_eval,
        }
        if adopt is not None:
            self._appliers[JobCommand.ADOPT] = partial(self._on_adopt, adopt)
        if model is not None:
            self._appliers[JobCommand.MODEL] = partial(self._on_model, model)

    def check(self) -> None:
        """Apply every queued command; returns when none is left and the task is not paused.

        Raises :class:`Stopped` or :class:`Lost` when the task must end.
        """
        while True:
            if self.reporter.lost is not None:
                raise Lost
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                break
            self._apply(cmd)
        self._check_stop_flag()

    def _check_stop_flag(self) -> None:
        """A stop the router still wants but whose command is gone (push lost, acknowledgement timed
        out): after the queued commands, so that a stop command there is acknowledged first."""
        if self.reporter.stop_requested.is_set():
            self._stop(handback=False)

    def _fresh(self, cmd: Command) -> bool:
        """True the first time a command of this job is seen."""
        if cmd.job != self.job or (cmd.seq and cmd.seq in self._applied):
            return False
        if cmd.seq:
            self._applied.add(cmd.seq)
        return True

    def _apply(self, cmd: Command) -> None:
        if not self._fresh(cmd):
            return
        try:
            command = JobCommand(cmd.command)
        except ValueError:
            command = None
        apply = self._appliers.get(command) if command is not None else None
        if apply is None:
            log.warning("job %s: unknown command %r ignored", self.job, cmd.command)
            return
        apply(cmd)

    def _on_stop(self, cmd: Command) -> None:
        log.info("job %s: %s received", self.job, cmd.command)
        handback = cmd.command == JobCommand.SHUTDOWN
        if not handback:
            self._ack(cmd, "stopping")
        self._stop(handback=handback)

    def _on_pause(self, cmd: Command) -> None:
        self._ack(cmd, JobState.PAUSED)
        if self.state is not JobState.PAUSED:
            self._pause()

    def _on_resume(self, cmd: Command) -> None:
        self._ack(cmd, JobState.RUNNING)  # not paused: nothing to do

    def _on_checkpoint(self, cmd: Command) -> None:
        self._ack(cmd, self.state, {"checkpoint": self._checkpoint()})

    def _on_set(self, cmd: Command) -> None:
        try:
            spec = self._set_hyper(cmd.args)
        except BadRequest as err:
            self._ack(cmd, self.state, {"error": str(err)})
            return
        log.info("job %s: set %s", self.job, cmd.args)
        self._ack(cmd, self.state, {"spec": spec, "set": cmd.args})

    def _on_eval(self, cmd: Command) -> None:
        # acknowledged from the evaluation's thread, with its result
        self._evaluate(lambda detail: self._ack(cmd, self.state, detail))

    def _on_adopt(self, adopt: Callable[[dict], dict], cmd: Command) -> None:
        try:
            self._ack(cmd, self.state, {"adopted": adopt(cmd.args)})
        except BadRequest as err:
            self._ack(cmd, self.state, {"error": str(err)})

    def _on_model(self, model: Callable[[], tuple[dict, bytes]], cmd: Command) -> None:
        detail, data = model()
        self._ack(cmd, self.state, detail, frames=[data])

    def _pause(self) -> None:
        """Consume no batches until resumed; stop, checkpoint and set still apply."""
        self.state = JobState.PAUSED
        log.info("job %s: paused", self.job)
        while True:
            if self.reporter.lost is not None:
                raise Lost
            self._report()
            try:
                cmd = self.commands.get(timeout=PAUSED_POLL_S)
            except queue.Empty:
                self._check_stop_flag()
                continue
            if cmd.command == JobCommand.RESUME and self._fresh(cmd):
                self.state = JobState.RUNNING
                log.info("job %s: resumed", self.job)
                self._ack(cmd, JobState.RUNNING)
                return
            if cmd.command == JobCommand.PAUSE and self._fresh(cmd):
                self._ack(cmd, JobState.PAUSED)
                continue
            self._apply(cmd)

    def _stop(self, handback: bool) -> None:
        self._before_stop()
        raise Stopped(handback)

    def _ack(self, cmd: Command, state: str, detail: dict | None = None, frames: list | None = None) -> None:
        if cmd.seq:
            self.reporter.put(
                CommandAck(
                    job=self.job,
                    command=cmd.command,
                    seq=cmd.seq,
                    state=state,
                    detail=detail or {},
                    frames=frames or [],
                )
            )
