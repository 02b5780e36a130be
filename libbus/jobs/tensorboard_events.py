"""A job's metrics as TensorBoard event files: written live by its attempt (the trainer's
``tensorboard_dir``), or after the fact from what the router keeps (``busctl job metrics JOB
--tensorboard DIR``). Both write the same tags, so ``tensorboard --logdir DIR`` reads either:

- ``train/loss``: each step's loss as the job's function gave it to ``job.step`` (live only: the router
  keeps no per-step figures), at that step;
- ``progress/loss``, ``progress/samples_per_s``, ``progress/data_wait_pct``: each progress report's running
  figures (what ``busctl job watch`` shows), at the report's step;
- ``data_wait/<part>``: the seconds the training loop waited for data so far, split by cause (the loader's
  stall split: ``read``, ``transfer``, ``stage:NAME``...), at the report's step;
- ``epoch/<metric>``: each epoch's record (``job.report``: ``train_loss``, ``val_loss``, a study's
  objective...), at the epoch's number, counted from 1.

One run folder per job: ``DIR/JOB``, a study's trial ``DIR/STUDY/trial-N`` (:func:`run_dir`). The writer is
tensorboardX's, imported only when events are written: it imports torch where torch is installed, so the
trainer service (which never imports torch) does not write them; its attempts do.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["EVENT_FILE_PREFIX", "JobEvents", "export_job", "run_dir", "wait_parts"]

#: What tensorboardX (and TensorFlow) name every event file: ``events.out.tfevents.<time>.<host>...``.
EVENT_FILE_PREFIX = "events.out.tfevents."
#: The job ids and study ids the router makes (services/router/store.py, study_store.py).
_JOB_ID = re.compile(r"j[0-9a-f]{10}")
_TRIAL_NAME = re.compile(r"(s[0-9a-f]{8})/([0-9]{1,6})")
#: Most parts of a stall split written per report, and what a part's name may be (it becomes a tag).
MAX_WAIT_PARTS = 32
_PART_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
#: The progress report's figures written under ``progress/``.
PROGRESS_FIGURES = ("loss", "samples_per_s", "data_wait_pct")


def run_dir(root: str | Path, job: str, name: str = "") -> Path:
    """The run folder of ``job`` under ``root``: ``root/STUDY/trial-N`` for a study's trial (its job is
    named ``STUDY/N`` by the router), else ``root/JOB``. Nothing a job's name says reaches the path
    unless it is a trial's name exactly (a name such as ``../x`` is a job's run folder, by its id).

    Raises:
        ValueError: ``job`` is not a job id.
    """
    if not _JOB_ID.fullmatch(job):
        raise ValueError(f"not a job id (j and 10 hex digits): {job!r}")
    trial = _TRIAL_NAME.fullmatch(name or "")
    if trial:
        return Path(root) / trial.group(1) / f"trial-{int(trial.group(2))}"
    return Path(root) / job


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def wait_parts(split: Any) -> dict[str, float]:
    """The parts of a stall split (``data_wait_split``) that make tags: finite non-negative seconds under
    at most :data:`MAX_WAIT_PARTS` plain names (a report was written by the job's own process)."""
    parts = split.get("parts") if isinstance(split, Mapping) else None
    if not isinstance(parts, Mapping):
        return {}
    out: dict[str, float] = {}
    for name, seconds in parts.items():
        value = _finite(seconds)
        if isinstance(name, str) and _PART_NAME.fullmatch(name) and value is not None and value >= 0:
            out[name] = value
            if len(out) == MAX_WAIT_PARTS:
                break
    return out


class JobEvents:
    """One run folder's event file, written through tensorboardX's ``SummaryWriter``.

    Args:
        directory: the run folder (created).
        flush_s: seconds between the writer's own flushes (each :meth:`progress` also flushes).

    Raises:
        OSError: the folder cannot be made.
    """

    def __init__(self, directory: str | Path, flush_s: float = 5.0):
        from tensorboardX import SummaryWriter  # noqa: PLC0415 - imports torch where there is one

        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(logdir=str(self.directory), flush_secs=max(1, round(flush_s)))

    def step(self, step: int, loss: float, wall_time: float | None = None) -> None:
        """One step's loss (``train/loss``); a loss that is not a finite number is left out."""
        value = _finite(loss)
        if value is not None:
            self._writer.add_scalar("train/loss", value, step, walltime=wall_time)

    def progress(self, report: Mapping[str, Any], wall_time: float | None = None) -> None:
        """A progress report's figures and stall split at its ``step``, then flushed."""
        step = report.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            return
        for figure in PROGRESS_FIGURES:
            value = _finite(report.get(figure))
            if value is not None:
                self._writer.add_scalar(f"progress/{figure}", value, step, walltime=wall_time)
        for part, seconds in wait_parts(report.get("data_wait_split")).items():
            self._writer.add_scalar(f"data_wait/{part}", seconds, step, walltime=wall_time)
        self._writer.flush()

    def epoch(self, record: Mapping[str, Any], wall_time: float | None = None) -> None:
        """An epoch's record (``epoch/<metric>``) at its epoch number; records without one are left out."""
        epoch = record.get("epoch")
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            return
        for name, raw in record.items():
            value = _finite(raw)
            if name != "epoch" and isinstance(name, str) and _PART_NAME.fullmatch(name) and value is not None:
                self._writer.add_scalar(f"epoch/{name}", value, epoch, walltime=wall_time)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> JobEvents:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def export_job(root: str | Path, job: Mapping[str, Any], reports: Iterable[Mapping[str, Any]]) -> Path:
    """Write what the router keeps of ``job`` (its record, as ``GetJob`` returns it) to its run folder
    under ``root``: its progress ``reports`` (``progress_history``, oldest first, each with its time ``at``)
    and its epoch records. Returns the run folder.

    Raises:
        FileExistsError: the run folder already holds event files (a live run's or an earlier
            export's): TensorBoard would show both, every point twice.
        OSError: the folder cannot be made or written.
    """
    directory = run_dir(root, str(job.get("id", "")), str((job.get("spec") or {}).get("name") or ""))
    if directory.is_dir() and any(p.name.startswith(EVENT_FILE_PREFIX) for p in directory.iterdir()):
        raise FileExistsError(
            f"{directory} already holds event files (a live run's or an earlier export's); TensorBoard would "
            "show every point twice: export to another folder, or remove those files first"
        )
    with JobEvents(directory) as events:
        for report in reports:
            events.progress(report, wall_time=_finite(report.get("at")))
        history = (job.get("progress") or {}).get("history") or []
        for record in history:
            if isinstance(record, Mapping):
                events.epoch(record, wall_time=_finite(job.get("updated")))
    return directory
