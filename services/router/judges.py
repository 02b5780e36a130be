"""What the router decides on its own, and the requests about it: studies (:mod:`.studies`: trials
made, pruned, PBT) and early stopping (:mod:`.early_stop`) judge each job's reports as they come and
at every tick; studies are submitted, listed, shown and stopped here. A mixin of
:class:`~.handler.RouterHandler`, kept here so that the handler only wires it in. (The model a task
carries: :mod:`.task_models`.)
"""

from __future__ import annotations

import logging

from libbus.errors import Forbidden
from libbus.jobs.spec import dataset_name
from libbus.security.auth import Claims
from libbus.serve.handler import serves
from libbus.serve.server import Session
from libbus.wire.messages import GetStudy, ListStudies, Ok, StopStudy, StudyInfo, StudyList, SubmitStudy

from ..importable import TrainerModules
from .early_stop import EarlyStopping
from .jobs import JobControl
from .store import JobStore
from .studies import Studies
from .study_spec import StudySpec, trial_spec

__all__ = ["Judges"]

log = logging.getLogger(__name__)


class Judges:
    """Studies and early stopping for the router's handler (which provides ``store`` and ``jobs``,
    its JobControl, and ``trainer_modules``, what its trainers can import)."""

    store: JobStore
    jobs: JobControl
    trainer_modules: TrainerModules

    def init_judges(self) -> None:
        self.studies = Studies(self.store, self.jobs.control)
        self.early_stopping = EarlyStopping(self.store, self.jobs.control, self.jobs.stop_requested)

    def tick_judges(self, now: float) -> None:
        for part in (self.studies, self.early_stopping):
            try:
                part.tick(now)
            except Exception:  # noqa: BLE001 - a bug in a strategy must not take the router down
                log.exception("%s failed; trying again at the next tick", type(part).__name__)

    def judge_report(self, job: str, progress: dict) -> None:
        """A job's progress report: its new epochs are judged at once (a study trial's pruning and
        PBT, a job's early stopping)."""
        history = progress.get("history")
        if not isinstance(history, list):
            return
        try:
            self.studies.on_report(job, len(history))
        except Exception:  # noqa: BLE001 - the report is stored; the next tick judges it again
            log.exception("study report of job %s", job)
        try:
            self.early_stopping.on_report(job, history)
        except Exception:  # noqa: BLE001 - a bug in the rule must not take the router down; the next report judges again
            log.exception("early stopping at a report of job %s", job)

    # -- studies ---------------------------------------------------------------------------------
    @serves(SubmitStudy, "admin")
    def on_SubmitStudy(self, session: Session, msg: SubmitStudy) -> StudyInfo:
        spec = StudySpec.from_dict(msg.spec)  # checked first: the scope is read from the checked [base]
        _check_study_scope(session.claims, spec.base.dataset)
        # every module its trials would name ([base], or a choice of entrypoint or model), as a job's at submit
        self.trainer_modules.check(spec.base)
        for name in ("entrypoint", "model"):
            param = spec.space.get(name)
            for value in param.values if param is not None and param.kind == "choice" else ():
                self.trainer_modules.check(trial_spec(spec.base, {name: value}))
        study = self.studies.submit(spec, session.subject)
        return StudyInfo(study=dict(self.studies.show(study).items()))  # the message's JSON object

    @serves(ListStudies, "admin")
    def on_ListStudies(self, session: Session, msg: ListStudies) -> StudyList:
        # a scoped token sees the studies it could ask about one by one
        return StudyList(studies=[s for s in self.studies.list() if _allows_study(session.claims, s["dataset"])])

    @serves(GetStudy, "admin")
    def on_GetStudy(self, session: Session, msg: GetStudy) -> StudyInfo:
        study, spec = self.studies.read(msg.study)
        _check_study_scope(session.claims, spec.base.dataset)
        return StudyInfo(study=dict(study.items()))

    @serves(StopStudy, "admin")
    def on_StopStudy(self, session: Session, msg: StopStudy) -> Ok:
        _check_study_scope(session.claims, self.studies.read(msg.study)[1].base.dataset)
        return Ok(detail=dict(self.studies.stop(msg.study, session.subject).items()))


def _allows_study(claims: Claims, dataset) -> bool:
    """Whether a token may see or act on a study whose trials run on ``dataset``: its ``datasets``
    scope covers it, and it has no ``jobs`` scope (a study's trials are jobs made after the token,
    which no ``jobs`` scope can name)."""
    return "jobs" not in claims.scopes and isinstance(dataset, str) and claims.allows_dataset(dataset_name(dataset))


def _check_study_scope(claims: Claims, dataset: str) -> None:
    """Raise :class:`Forbidden` unless :func:`_allows_study` for a study of ``dataset`` (its [base]'s),
    naming the scope that refuses."""
    if "jobs" in claims.scopes:
        raise Forbidden(
            "a token limited to jobs cannot submit or see studies: their trials are new jobs no jobs scope names"
        )
    claims.check_dataset(dataset_name(dataset))
