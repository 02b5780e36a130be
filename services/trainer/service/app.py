"""``busctl start trainer``: ask the router for tasks, run them, push results, repeat."""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
from collections import Counter

from libbus.config import Settings
from libbus.connect.link import Link
from libbus.errors import BusError, Forbidden, PeerTimeout, TooLarge
from libbus.jobs.commands import JobCommand
from libbus.jobs.spec import JobSpec
from libbus.jobs.state import JobState
from libbus.serve.metrics import MetricsExporter, start_exporter
from libbus.wire.messages import Command, GetTask, Message, NoTask, PushResult, Task
from libbus.wire.text import cut_json

from ... import credentials, process
from ...importable import announce
from ...sdnotify import Notifier
from .. import attempt_user
from ..channel import LOST
from ..failures import describe_failure
from ..grant import withhold_environment
from ..reports import Reporter
from .attempt_run import ERROR_BYTES, MAX_WAIT_PARTS, MODEL_HEADROOM, AttemptRun, warm_up
from .attempt_settings import not_dumpable
from .metrics import TrainerStats, trainer_metrics

__all__ = ["TrainerService", "run_trainer"]

log = logging.getLogger(__name__)

#: How long a finished task's result may wait for an absent router before it is given up.
PUSH_RESULT_PATIENCE_S = 600.0


def add_parts(into: dict[str, float], parts: dict[str, float]) -> None:
    """Add an attempt's data wait by part to ``into``; a part name past ``MAX_WAIT_PARTS`` kinds
    counts as ``other`` (each name is a Prometheus label value: their number stays bounded)."""
    for name, seconds in parts.items():
        known = name in into or len(into) < MAX_WAIT_PARTS
        key = name if known else "other"
        into[key] = into.get(key, 0.0) + seconds


class TrainerService:
    """A trainer: asks the router for tasks and runs them. ``notifier`` tells systemd it is ready
    (once started, whether or not the router answers yet: it may be restarting), what it does
    (``STATUS=``), and is fed between training steps and task requests (the watchdog)."""

    def __init__(self, settings: Settings, notifier: Notifier | None = None):
        self.settings = settings
        #: The user its attempts run as (``attempt_user``, checked here as it starts), or None: its own.
        self.attempt_user = attempt_user.resolve(settings)
        self.notifier = notifier or Notifier()
        self.name = credentials.service_name(settings, "trainer")
        # what jobs may import here, and what of it this node can import: the router refuses at submit
        # a job naming a module no trainer can import (services/importable.py)
        caps = {"job_modules": announce(settings.job_modules)}
        self.identity = credentials.identity(settings, "trainer", self.name, caps)
        self.commands: queue.Queue[Command] = queue.Queue()
        self.current_job: str | None = None
        #: Jobs run to an end, by final state (succeeded, failed, stopped).
        self.tasks: Counter = Counter()
        #: Seconds the jobs that ended waited for data; the running one's come from its loader.
        self.data_wait_done = 0.0
        #: The ended attempts' data wait by part (the running one's is added when read).
        self.data_wait_parts_done: dict[str, float] = {}
        self.run_now: AttemptRun | None = None
        #: The Prometheus endpoint while running (``metrics_bind`` set), else ``None``.
        self.metrics: MetricsExporter | None = None
        self.link = Link(
            settings.router,
            self.identity,
            heartbeat_ms=settings.heartbeat_ms,
            liveness=settings.heartbeat_liveness,
            on_push=self._on_push,
            stats=self.stats,
            limits=credentials.limits(settings),
        )

    def _on_push(self, msg: Message) -> None:
        if isinstance(msg, Command):
            self.commands.put(msg)

    def stats(self) -> TrainerStats:
        """The trainer's heartbeat stats, its ``Stats`` row and what its metrics read."""
        run = self.run_now
        waited = run.data_wait_s if run is not None else 0.0
        parts = dict(self.data_wait_parts_done)
        add_parts(parts, run.data_wait_parts if run is not None else {})
        return {
            "job": self.current_job,
            "tasks": dict(self.tasks),
            "connected": self.link.connected.is_set(),
            "data_wait_s": self.data_wait_done + waited,
            "data_wait_parts": parts,
        }

    def run(self, stop: threading.Event) -> int:
        self.metrics = start_exporter(self.settings.metrics_bind, "trainer", self.name, self.stats, trainer_metrics)
        self.link.start()
        router = self.settings.router
        self.notifier.ready(f"waiting for the router at {router}")
        threading.Thread(target=warm_up, name="fork-server", daemon=True).start()  # attempts fork from it
        # A stop (SIGTERM) also ends a running task: it is put on the command queue.
        watcher = threading.Thread(target=self._watch_stop, args=(stop,), daemon=True)
        watcher.start()
        try:
            ask = secrets.token_hex(8)
            while not stop.is_set():
                self.notifier.watchdog()
                self.notifier.status(
                    f"idle: asking {router} for a task"
                    if self.link.connected.is_set()
                    else f"waiting for the router at {router}"
                )
                if self.link.fatal is not None:
                    log.error("router refused trainer %s: %s", self.name, self.link.fatal)
                    return 1
                try:
                    # the same key until a reply comes: an ask whose reply was lost, asked again,
                    # gets the job it was given (no abandoned attempt)
                    reply = self.link.request(GetTask(key=ask), timeout_s=self.settings.request_timeout_s)
                    ask = secrets.token_hex(8)
                except PeerTimeout:
                    continue  # router away: keep asking
                except BusError as err:
                    if self.link.fatal is not None:
                        continue
                    log.warning("GetTask failed: %s", err)
                    stop.wait(1.0)
                    continue
                if isinstance(reply, NoTask):
                    stop.wait(reply.retry_ms / 1000)
                elif isinstance(reply, Task):
                    if not self._run_task(reply, stop):
                        log.error(
                            "trainer %s exits: its last gang's process group could not be left "
                            "(its supervisor starts a fresh trainer)",
                            self.name,
                        )
                        return 1
            return 0
        finally:
            if self.metrics is not None:
                self.metrics.close()
            self.link.close()

    def _watch_stop(self, stop: threading.Event) -> None:
        stop.wait()
        if self.current_job:
            self.commands.put(Command(job=self.current_job, command=JobCommand.SHUTDOWN))

    def _run_task(self, task: Task, stop: threading.Event) -> bool:
        """Run ``task`` and report how it ended; False when this process cannot take another task."""
        self._drop_stale_commands()
        self.current_job = task.job
        if stop.is_set():  # SIGTERM came between GetTask and here: hand it straight back
            self.commands.put(Command(job=task.job, command=JobCommand.SHUTDOWN))
        log.info("running job %s%s", task.job, f" from checkpoint step {task.resume['step']}" if task.resume else "")
        reporter = Reporter(self.link, task.job, self.settings.request_timeout_s, on_command=self.commands.put)
        clean = True
        final_model: bytes | None = None  # as the attempt had it scored
        state: JobState | str  # or LOST: the router gave the job to another trainer
        try:
            try:
                # every attempt in a process of its own: the built-in loop or the job's entrypoint
                spec = JobSpec.from_dict(task.spec)  # the task enters the trainer here: parsed once, typed on
                run = AttemptRun(
                    task,
                    spec,
                    self.settings,
                    self.link,
                    self.identity,
                    self.commands,
                    attempt=task.attempt,
                    notifier=self.notifier,
                    attempt_user=self.attempt_user,
                )
            except Exception as err:  # noqa: BLE001 - a spec this trainer cannot even set up: the job fails, not us
                state, result, error = JobState.FAILED, {"retryable": False}, describe_failure(err, None)
                log.error("job %s failed before it started: %s", task.job, error)
            else:
                self.run_now = run
                state, result, error = run.run()
                clean, final_model = not run.unclean, run.final_model
            self._flush(reporter, stop)
        finally:
            reporter.close()
            if self.run_now is not None:
                self.data_wait_done += self.run_now.data_wait_s
                add_parts(self.data_wait_parts_done, self.run_now.data_wait_parts)
            self.current_job, self.run_now = None, None
        self.tasks[str(state)] += 1  # a plain str key: the stats go out as JSON
        if task.rank > 0:  # rank 0 reports for the gang (services/trainer/attempt/gang.py)
            log.info("job %s: rank %d of %d ended %s %s", task.job, task.rank, task.world_size, state, error)
            return clean
        if state == LOST:
            log.warning("job %s abandoned: %s", task.job, error)
            return clean
        if state == JobState.QUEUED:
            log.info("job %s handed back to the router (shutting down)", task.job)
        msg = PushResult(job=task.job, state=state, result=result, error=error)
        if state == JobState.SUCCEEDED:
            msg.frames = self._final_weights(result, final_model)
        self._push_result(msg, stop)
        return clean

    def _final_weights(self, result: dict, blob: bytes | None) -> list[bytes]:
        """The final model's bytes as the attempt read them once and had them scored (``blob``; never
        the file again, which the job's code may have changed since), sent with the result for the
        router to keep (``busctl job model``); none when they would not fit in one message."""
        if blob is None:
            model = result.get("model") or {}
            if model.get("path"):
                log.info(
                    "final model %s stays on this trainer only (%s bytes; messages carry at most %d)",
                    model.get("path"),
                    model.get("bytes"),
                    self.settings.max_msg_bytes - MODEL_HEADROOM,
                )
            return []
        return [blob]

    def _flush(self, reporter: Reporter, stop: threading.Event) -> None:
        """Progress, checkpoint records and acknowledgements go before the result: wait for them
        (bounded; shorter once the service is stopping, so SIGTERM still ends it promptly)."""
        started = time.monotonic()
        while not reporter.flush(0.5):
            self.notifier.watchdog()
            waited = time.monotonic() - started
            if waited > PUSH_RESULT_PATIENCE_S or (stop.is_set() and waited > self.settings.request_timeout_s):
                log.warning("job %s: %d report(s) could not be delivered", reporter.job, reporter.pending)
                return

    def _drop_stale_commands(self) -> None:
        """Whatever is queued predates this task (an earlier job's, or an earlier attempt's at this
        one: the same job may come back). A command sent as the task was assigned is not lost: the
        router repeats unacknowledged commands in its replies to progress reports."""
        while not self.commands.empty():
            self.commands.get_nowait()

    def _push_result(self, msg: PushResult, stop: threading.Event) -> None:
        """Deliver the result, waiting out a router restart (bounded)."""
        waited, replaced = 0.0, False
        while waited < PUSH_RESULT_PATIENCE_S:
            self.notifier.watchdog()  # each try is bounded by request_timeout_s; the patience is not
            try:
                self.link.request(msg, timeout_s=self.settings.request_timeout_s)
                log.info("job %s: %s, result delivered", msg.job, msg.state)
                return
            except Forbidden as err:
                log.warning("job %s: result refused: %s", msg.job, err)
                return
            except PeerTimeout:
                waited += self.settings.request_timeout_s
                if stop.is_set():
                    break
                continue
            except BusError as err:
                if isinstance(err, TooLarge) and not msg.frames and not replaced:
                    # a result the job's code made too large to send or store: the attempt fails saying so
                    log.error("job %s: its result cannot be sent: %s", msg.job, err)
                    why = cut_json(f"the attempt's result could not be sent to the router: {err}", ERROR_BYTES)
                    msg, replaced = PushResult(job=msg.job, state=JobState.FAILED, result={}, error=why), True
                    continue
                if not msg.frames:
                    log.error("job %s: result refused: %s", msg.job, err)
                    return
                log.warning("job %s: router refused the final model (%s); sending the result without it", msg.job, err)
                msg.frames = []
                continue
        log.error("job %s: could not deliver its result to the router; giving up", msg.job)


def run_trainer(settings: Settings) -> int:
    # Attempts fork from a fork server this process starts: it must not hand them, in its environment,
    # what names or holds this trainer's credentials (read into ``settings`` already). Nor may they
    # read this process's memory or environment through /proc (same uid): not dumpable.
    withhold_environment(os.environ)
    not_dumpable()
    stop, notify = threading.Event(), process.notifier()
    process.install_signal_handlers(stop, notify)
    process.clean_shm()
    service = TrainerService(settings, notify)
    if settings.gc_freeze:
        process.freeze_startup_heap()
    try:
        return service.run(stop)
    finally:
        process.finish(notify)
