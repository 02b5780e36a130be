"""One attempt of a job, in a process of its own: forked from the trainer's fork server
(:mod:`services.trainer.service.attempt_run` starts it and is its only peer).

The child calls the job's function with an :class:`.jobapi.AttemptJob`: the built-in loop
(:func:`.builtin.train`) for a job that names a ``model``, or the job's ``entrypoint``, imported only
if the trainer's ``job_modules`` allows it; then it tells the parent how it ended. (An evaluation
task, :func:`.evaltask.run_evaluation`, trains nothing.) Its log records go to the parent as records
(:class:`ParentLogHandler`), its systemd status line through it (:class:`ParentNotifier`). It holds no connection to the
router: its requests (progress, checkpoint records, acknowledgements, finding the dataset's
providers) go through the parent over the channel (:class:`ParentLink`), and the parent passes the
router's commands on. It reads batches from the providers itself, and has its models scored there,
with its job's grant (:mod:`..grant`): an ``attempt`` token of its trainer's subject scoped to the job
and its dataset. Its settings and environment hold none of its trainer's credentials; under a root
trainer with ``attempt_user`` it runs as that user (:mod:`..attempt_user`) before anything of the job's
runs. Its final model is read once (:func:`final_model`): the bytes it has scored are the bytes it hands
its trainer for the router to keep.

It dies with its parent (``PR_SET_PDEATHSIG``), ignores SIGINT and SIGTERM (the parent asks it to
stop, with a checkpoint, and kills it after ``stop_grace_s``), and offers itself first to the kernel's
out-of-memory killer (``oom_score_adj``), so a job that exhausts memory ends its attempt, not its trainer.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import io
import itertools
import logging
import os
import queue
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from libbus.config import Settings
from libbus.connect.client import Identity
from libbus.errors import BadRequest, BusError, PeerTimeout, error_from_code
from libbus.jobapi import JobEnded, ModelRecord
from libbus.jobs.spec import JobSpec
from libbus.jobs.state import JobState
from libbus.wire.frames import decode, encode
from libbus.wire.messages import Command, Message, Resolve, Task
from services import credentials
from services.sdnotify import Notifier
from services.usercode import import_allowed

from ..attempt_user import AttemptUser, become, job_folder
from ..channel import LOST, Channel, ChannelClosed
from ..failures import deterministic, failed_attempt, own_code_failure
from ..grant import GrantSource, withhold_environment
from ..reports import Reporter
from . import builtin
from .evaltask import run_evaluation
from .final_eval import EVALUATE_TIMEOUT_S, score_saved
from .gang import Gang, GangError, advertised_host
from .jobapi import AttemptJob
from .progress import perplexity

__all__ = ["ParentLink", "ParentLogHandler", "ParentNotifier", "child_main", "main"]

log = logging.getLogger("batchbus.job")

#: How often the child tells its parent how far the function has got (see AttemptJob.activity).
BEAT_S = 1.0
#: Room left in a message for the result beside the final model's bytes: a model larger than
#: ``max_msg_bytes`` less this stays on the trainer (the router keeps none of it).
MODEL_HEADROOM = 1 << 20
_PR_SET_PDEATHSIG = 1


class ParentLink:
    """The child's stand-in for :class:`libbus.connect.link.Link`: ``request`` goes through the parent."""

    def __init__(self, channel: Channel):
        self.channel = channel
        #: What a Link holds once its router refused it for good; the parent deals with that here.
        self.fatal: BusError | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, Future] = {}
        self._lock = threading.Lock()

    def request(self, msg: Message, timeout_s: float = 10.0) -> Any:
        fut: Future = Future()
        with self._lock:
            rid = next(self._ids)
            self._waiting[rid] = fut
        try:
            self.channel.send("request", encode(msg), id=rid, timeout_s=timeout_s)
            try:
                return fut.result(timeout=timeout_s + 5.0)
            except TimeoutError:
                raise PeerTimeout(f"no answer through the trainer within {timeout_s:.0f} s") from None
        finally:
            with self._lock:
                self._waiting.pop(rid, None)

    def answer(self, header: dict, frames: list[bytes]) -> None:
        with self._lock:
            fut = self._waiting.get(header.get("id", 0))
        if fut is None:
            return
        if header.get("ok"):
            fut.set_result(decode(frames))
        elif header.get("code") == "PEER_TIMEOUT":
            fut.set_exception(PeerTimeout(str(header.get("message", ""))))
        else:
            fut.set_exception(error_from_code(str(header.get("code")), str(header.get("message", ""))))

    def fail_all(self, why: str) -> None:
        with self._lock:
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_exception(PeerTimeout(why))


class ParentNotifier(Notifier):
    """An attempt's systemd notifier: its status lines go to the trainer, which
    tells systemd (``STATUS=`` of the trainer's unit), and a wait it announces as longer than usual
    (an evaluation) widens the trainer's hang check for that long. The trainer feeds the watchdog."""

    def __init__(self, channel: Channel):
        super().__init__()
        self.channel = channel

    def status(self, text: str) -> bool:
        if text == self._last_status:
            return False
        self._last_status = text
        return self._tell("status", text=text)

    def watchdog(self) -> bool:
        return False

    @contextlib.contextmanager
    def extended(self, seconds: float) -> Iterator[None]:
        self._tell("extend", seconds=seconds)
        try:
            yield
        finally:
            self._tell("extend", seconds=0.0)

    def _tell(self, op: str, **fields: Any) -> bool:
        try:
            self.channel.send(op, **fields)
        except ChannelClosed:
            return False
        return True


class ParentLogHandler(logging.Handler):
    """Log records of the attempt go to the trainer as records (logger name, level, text), which it
    logs under the same name and level and keeps with the attempt's output (``busctl job logs``)."""

    def __init__(self, channel: Channel):
        super().__init__()
        self.channel = channel
        self.setFormatter(logging.Formatter("%(message)s"))
        self._inside = threading.local()

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(self._inside, "active", False):  # a record logged while sending one
            return
        self._inside.active = True
        try:
            self.channel.send("log", name=record.name, level=record.levelno, text=self.format(record))
        except Exception:  # noqa: BLE001 - a closed channel or an unformattable record: never the attempt's end
            pass
        finally:
            self._inside.active = False


def _die_with_parent() -> None:
    """Die with the fork server (which ends with its trainer): no attempt outlives its trainer."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the channel's end still ends this process
        pass
    if os.getppid() == 1:  # the parent died before the line above
        os._exit(1)
    try:  # the out-of-memory killer takes this attempt before the trainer service
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _read_channel(channel: Channel, link: ParentLink, commands: queue.Queue[Command]) -> None:
    """The parent's answers and the router's commands; the parent gone ends this process."""
    try:
        while True:
            got = channel.recv()
            if got is None:
                continue
            header, frames = got
            if header["op"] == "reply":
                link.answer(header, frames)
            elif header["op"] == "command":
                msg = decode(frames)
                if isinstance(msg, Command):
                    commands.put(msg)
    except ChannelClosed:
        link.fail_all("the trainer is gone")
        os._exit(1)


def _beat(channel: Channel, activity: Callable[[], tuple], done: threading.Event) -> None:
    """Tell the parent how far the attempt has got, every :data:`BEAT_S` (it finds hangs by it)."""
    while not done.wait(BEAT_S):
        try:
            channel.send("beat", activity=repr(activity()))
        except ChannelClosed:
            return


#: How an attempt ended, as its trainer pushes it: state, result, error, and the final model's bytes
#: (read once: the bytes scored are the bytes the trainer sends to the router), if it sends them.
Ended = tuple[JobState | str, dict, str, list[bytes]]


def run(channel: Channel, start: dict, frames: list[bytes]) -> Ended:
    """Import, set up and call the function; how the attempt ended as the trainer pushes it."""
    settings = Settings(**start["settings"])
    task = Task(**start["task"])
    task.frames = frames[:1]  # the weights of model_from, if the job names one
    spec = JobSpec.from_dict(task.spec)  # parsed once as it enters this process, typed from here
    job_id = task.job
    link = ParentLink(channel)
    commands: queue.Queue[Command] = queue.Queue()
    threading.Thread(target=_read_channel, args=(channel, link, commands), daemon=True).start()
    reporter = Reporter(link, job_id, settings.request_timeout_s, on_command=commands.put)  # type: ignore[arg-type]  # a Link in all it uses
    identity = attempt_identity(settings, start["name"], job_id, str(start.get("grant", "")), link)
    if start.get("attempt_user"):  # the trainer runs as root: nothing of the job's runs as root
        become(AttemptUser.from_dict(start["attempt_user"]), job_folder(settings.checkpoint_dir, job_id))
    notifier = ParentNotifier(channel)

    if spec.task == "evaluate":  # score a stored model, no training (.evaltask)
        channel.send("started")
        try:
            with notifier.extended(EVALUATE_TIMEOUT_S):
                return (*run_evaluation(task, spec, settings, link, identity), [])  # type: ignore[arg-type]  # a Link in all it uses
        finally:
            reporter.close()

    def resolver(timeout_s: float) -> list[dict]:
        return link.request(Resolve(dataset=spec.dataset), timeout_s=timeout_s).providers

    gang = None
    if task.world_size > 1:  # every rank's function starts with torch.distributed initialized
        device = torch.device(spec.device)
        host = advertised_host(settings.advertise, settings.router)
        gang = Gang(task, link, host, device, settings.request_timeout_s)  # type: ignore[arg-type]  # a Link in all it uses
    providers = start["providers"]
    job = AttemptJob(
        task,
        spec,
        settings,
        identity,
        reporter,
        commands,
        providers=providers,
        resolver=resolver,
        attempt=int(start.get("attempt", 0)),
        gang=gang,
        provider=next((p for p in providers if p.get("name") == start.get("provider_name")), None),
        notifier=notifier,
    )
    done = threading.Event()
    threading.Thread(target=_beat, args=(channel, job.activity, done), daemon=True).start()
    evaluation_wait_s = EVALUATE_TIMEOUT_S  # a live evaluation's acknowledgement goes before the result
    try:
        if job.spec.entrypoint:
            function = import_allowed(
                job.spec.entrypoint, settings.job_modules, f"entrypoint {job.spec.entrypoint!r}", setting="job_modules"
            )
            if not callable(function):
                raise BusError(f"entrypoint {job.spec.entrypoint!r} is a {type(function).__name__}, not a function")
        else:  # the built-in loop, on the same job API
            function = builtin.train
        log.info("job %s: calling %s (attempt %d)", job_id, job.spec.entrypoint or "the built-in loop", job.attempt)
        channel.send("started")  # set up (a gang met, the module imported): its silence is watched from here
        job._commands()  # a stop or pause sent as the attempt began
        function(job)
        result = {
            **job.progress(),
            "model": job.model_record,
            "provider": start.get("provider_name", ""),
            "world_size": task.world_size,
        }
        last = job.history[-1] if job.history else {}
        result.update({k: v for k, v in last.items() if k.startswith("val_")})
        blob = final_model(job.model_record) if job.model_record and job.lead else None
        # scored by the job's evaluator, or (a built-in job) by its model built on the provider
        scored = job.spec.evaluator or not job.spec.entrypoint
        if job.spec.evaluate and scored and blob is not None:
            with notifier.extended(EVALUATE_TIMEOUT_S):
                result.update(_scored(job, blob, start, link, identity, settings))
        sent = blob is not None and len(blob) <= settings.max_msg_bytes - MODEL_HEADROOM
        return JobState.SUCCEEDED, result, "", [blob] if sent and blob is not None else []
    except JobEnded as ended:
        result = {"history": job.history, "checkpoint": job.last_checkpoint}
        if job.ended == "lost":
            evaluation_wait_s = 0.0  # the router takes nothing more of this job from here
            return LOST, {}, str(reporter.lost or ended), []
        if job.ended == "handback" or ended.handback:
            evaluation_wait_s = settings.request_timeout_s  # a trainer shutting down waits less
            return JobState.QUEUED, result, "trainer shutting down", []
        return JobState.STOPPED, result, "", []
    except BaseException as err:  # noqa: BLE001 - SystemExit too: whatever the function does ends this attempt only
        if gang is not None and isinstance(err, RuntimeError) and not deterministic(err):
            # a collective inside backward() (DDP) breaks when another rank is gone: retried
            err = GangError(f"rank {task.rank}: the gang broke: {err}")
        state, result, error = failed_attempt(err, job.spec)
        if job.spec.entrypoint and not isinstance(err, BusError):
            checkpoint = job.last_checkpoint["step"] if job.last_checkpoint else None
            where = own_code_failure(err, job.spec.entrypoint, job_id, job.step_count, checkpoint)
            error = f"{error} ({where})" if where else error
        log.error("job %s failed: %s", job_id, error, exc_info=not isinstance(err, BusError))
        return state, {"history": job.history, **result}, error, []
    finally:
        done.set()
        job.close()
        if job.evaluations.running:
            with notifier.extended(evaluation_wait_s):
                job.evaluations.join(evaluation_wait_s)
        if not reporter.flush(settings.request_timeout_s):
            log.warning("job %s: %d report(s) not delivered", job_id, reporter.pending)
        reporter.close()


def attempt_identity(settings: Settings, name: str, job: str, grant: str, link: ParentLink) -> Identity:
    """Who the attempt is at providers: its job's grant (renewed through the trainer), its trainer's
    name, host id and CURVE key pair (the key's name is the grant's subject). A task without a grant
    (its router holds no signing key) came with its trainer's token: the attempt is its trainer
    (:func:`services.trainer.service.attempt_settings.ungranted_settings`)."""
    if not grant:
        return credentials.identity(settings, "trainer", name)
    return Identity(
        role="attempt",
        name=name,
        token=GrantSource(job, grant, lambda msg: link.request(msg, timeout_s=settings.request_timeout_s)),
        host_id=settings.host_id,
        curve=credentials.curve_keys(settings, "trainer"),
        router_key=credentials.router_key(settings),
        handshake=settings.handshake_auth,
    )


def final_model(record: ModelRecord) -> bytes:
    """The final model's bytes, read once from the file ``job.save_model`` wrote (``record``): the
    bytes scored are the bytes sent to the router, whatever happens to the file after.

    Raises:
        BadRequest: the file cannot be read, or is not what ``job.save_model`` wrote (its sha256):
            the job changed it after saving, and the attempt fails rather than score or keep it.
    """
    path = str(record.get("path", ""))
    try:
        blob = Path(path).read_bytes()
    except OSError as err:
        raise BadRequest(f"the final model {path} cannot be read: {err.strerror or err}") from err
    digest = hashlib.sha256(blob).hexdigest()
    if digest != record.get("sha256"):
        raise BadRequest(
            f"the final model {path} changed after job.save_model wrote it (sha256 {digest[:12]}…, "
            f"written {str(record.get('sha256'))[:12]}…): it is neither scored nor kept; save the final "
            "model once, with job.save_model, after training"
        )
    return blob


def _scored(job: AttemptJob, blob: bytes, start: dict, link: ParentLink, identity, settings: Settings) -> dict:
    """The saved model's bytes (``blob``, read once: :func:`final_model`) scored on the provider's
    private test split by the evaluator the job names (installed there by its operator); the
    provider reports the score, with the bytes' sha256, to the router itself."""
    providers = start["providers"]
    provider = next((p for p in providers if p.get("name") == start.get("provider_name")), providers[0])
    evaluation = score_saved(
        blob,
        job.id,
        job.spec,
        provider,
        link=link,  # type: ignore[arg-type]  # a Link in all it uses
        identity=identity,
        settings=settings,
        check=job._commands,
    )
    noise = ""
    if evaluation.epsilon:  # released noised (docs/security.md §9): say how far from exact it may lie
        from services.provider.score_release import margin  # noqa: PLC0415 - the release's own rule

        noise = f" ± {margin('accuracy', evaluation.n, evaluation.epsilon):.4f} at 95% (noise of the release)"
    log.info(
        "job %s: provider-side test accuracy %.4f%s on %d samples (%s)",
        job.id,
        evaluation.accuracy,
        noise,
        evaluation.n,
        job.spec.evaluator or job.spec.model,
    )
    scores = {"test_loss": evaluation.loss, "test_accuracy": evaluation.accuracy, "test_n": evaluation.n}
    if job.history and "val_perplexity" in job.history[-1]:  # a language model's: compared by perplexity
        scores["test_perplexity"] = perplexity(evaluation.loss)
    return scores


def child_main(channel_end: socket.socket, output: socket.socket) -> None:
    """An attempt's process, forked from the trainer's fork server (:func:`services.trainer.service.attempt_run.attempt_context`):
    its stdout and stderr go to ``output``, its channel is ``channel_end``."""
    os.dup2(output.fileno(), 1)
    os.dup2(output.fileno(), 2)
    output.close()
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="replace", line_buffering=True
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="replace", line_buffering=True
    )
    code = main(channel_end.detach())
    # os._exit: threads the function left running (a DataLoader's workers, a logger's) must not keep
    # a finished attempt alive
    os._exit(code)


def main(fd: int) -> int:
    _die_with_parent()
    withhold_environment(os.environ)  # (the fork server's was cleaned as the trainer started: this again)
    channel = Channel(fd)
    got = channel.recv()
    if got is None or got[0]["op"] != "start":
        return 2
    start, frames = got
    root = logging.getLogger()
    root.handlers[:] = [ParentLogHandler(channel)]
    root.setLevel(start["settings"].get("log_level", "INFO"))
    threads = start["settings"].get("torch_threads", 0)
    if isinstance(threads, int) and threads > 0:  # the trainer's torch_threads: its attempts' torch
        torch.set_num_threads(threads)
    model: list[bytes] = []
    try:
        state, result, error, model = run(channel, start, frames)
    except BaseException as err:  # noqa: BLE001 - set-up itself failed: say so, do not leave the parent guessing
        # (a gang whose ranks did not meet is retried, as a gang that broke later is)
        state, result, error = failed_attempt(err, None)
        log.error("attempt could not start: %s", error)
    sys.stdout.flush()
    sys.stderr.flush()
    channel.send("result", model, state=str(state), result=result, error=error)
    return 0
