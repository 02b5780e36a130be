"""A gang's commands, applied in step (:mod:`.gang`, "one decision per step"): at every point where
the training loop applies commands, rank 0 applies the router's and every rank then does what rank 0
decided, at this same step. A rank above 0 hears no commands from the router; only its own trainer's
shutdown, which hands the whole gang's job back."""

from __future__ import annotations

import logging
from collections.abc import Callable

from libbus.jobs.commands import JobCommand
from libbus.jobs.spec import SETTABLE, JobSpec

from .control import Controls, Stopped
from .gang import Code, Gang, GangError

__all__ = ["Lockstep"]

log = logging.getLogger(__name__)


class Lockstep:
    """One rank's side of the gang's decisions.

    Args:
        gang: the job's gang.
        controls: the task's commands (rank 0 applies them; the other ranks only read a shutdown).
        job: the task's job (for the log).
        lead: this is rank 0.
        spec: the task's spec now (its settable hyper-parameters go to the other ranks).
        set_hyper: applies rank 0's hyper-parameters on this rank.
        watchdog: fed while a rank above 0 waits out a pause.
        handback: rank 0 checkpoints before the gang hands the job back (no error if it cannot).
    """

    def __init__(
        self,
        gang: Gang,
        controls: Controls,
        *,
        job: str,
        lead: bool,
        spec: Callable[[], JobSpec],
        set_hyper: Callable[[dict], object],
        watchdog: Callable[[], object],
        handback: Callable[[], None],
    ):
        self.gang = gang
        self.controls = controls
        self.job = job
        self.lead = lead
        self.spec = spec
        self.set_hyper = set_hyper
        self.watchdog = watchdog
        self.handback = handback
        #: This rank's trainer is shutting down (a rank above 0 keeps asking the gang to hand back).
        self.shutting_down = False

    def hyper(self) -> dict:
        """The spec's settable hyper-parameters now."""
        return {k: getattr(self.spec(), k) for k in SETTABLE}

    def check(self) -> None:
        """Apply commands: rank 0 :meth:`Controls.check`, then every rank what rank 0 decided."""
        if self.lead:
            self.controls.check()  # a stop has told the gang already (TaskRun._before_stop)
            self._follow(*self.gang.sync(Code.RUN, self.hyper()))
            return
        self._follow(*self.gang.sync(self._own_code(), self.hyper()))

    def paused(self) -> None:
        """Rank 0 is paused: keep the gang paused."""
        self._follow(*self.gang.sync(Code.PAUSE, self.hyper()))

    def stop(self) -> None:
        """Rank 0 stops or hands the job back: the gang's other ranks stop at this same step."""
        try:
            self.gang.sync(Code.STOP, self.hyper())
        except GangError as err:  # the others are gone already: the stop stands
            log.warning("job %s: %s", self.job, err)

    def _own_code(self) -> Code:
        """A rank above 0 hears no commands from the router; only its own trainer's shutdown."""
        while not self.controls.commands.empty():
            if self.controls.commands.get_nowait().command == JobCommand.SHUTDOWN:
                self.shutting_down = True
        return Code.HANDBACK if self.shutting_down else Code.RUN

    def _follow(self, code: Code, hyper: dict) -> None:
        """Do what the gang decided: take rank 0's hyper-parameters, wait out a pause, end."""
        if not self.lead and hyper != self.hyper():
            self.set_hyper(hyper)
        while code == Code.PAUSE and not self.lead:
            self.watchdog()
            code, hyper = self.gang.sync(self._own_code(), self.hyper())
            if hyper != self.hyper():
                self.set_hyper(hyper)
        if code == Code.RUN or (self.lead and code == Code.PAUSE):
            return
        if self.lead:  # another rank's trainer is shutting down: the gang hands the job back
            log.info("job %s: a rank of the gang is shutting down; handing the job back", self.job)
            self.handback()
        raise Stopped(handback=code == Code.HANDBACK)
