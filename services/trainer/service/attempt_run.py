"""One attempt of a job, run by the trainer service in a child process (:mod:`..attempt.child`) forked
from the trainer's fork server (:mod:`..attempt.forkserver`).

The trainer keeps its connection to the router; the child runs the user's function (an entrypoint
job) or the built-in loop (:mod:`..attempt.builtin`). Here, the trainer's side:

- an entrypoint's module is checked against ``job_modules`` before any process starts (the child
  checks again before it imports);
- the child's log records are logged here under their own logger and level, its status line and
  announced long waits go to systemd and the hang check;
- the child's requests (progress, checkpoint records, acknowledgements, the dataset's providers)
  are relayed to the router, and the router's commands to the child;
- under a root trainer with ``attempt_user``, the job's own checkpoint folder is lent to that user
  while the attempt runs, what the attempt left running is ended after it, and the folder taken back
  (:mod:`..attempt_user`);
- the final model's bytes come from the child as it had them scored, never read from its file again;
- the child's output (stdout and stderr) is kept per attempt, the last ``attempt_log_bytes`` of it,
  and sent to the router for ``busctl job logs``;
- a child that ends without a result (a segfault, the out-of-memory killer, ``os._exit``), that
  stops making progress for ``attempt_silence_s`` (hung), or that has not ended ``stop_grace_s``
  after a stop or hand-back is killed, and only this attempt fails: its error names how it ended,
  with the last lines of its output and a hint; the trainer goes on to its next job.
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import math
import multiprocessing
import multiprocessing.forkserver
import queue
import re
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import BinaryIO

from libbus.config import Settings
from libbus.connect.client import Identity, pick_provider
from libbus.connect.link import Link
from libbus.errors import BusError, NotFound, PeerTimeout
from libbus.jobs.commands import JobCommand
from libbus.jobs.spec import JobSpec
from libbus.jobs.state import JobState
from libbus.wire.frames import decode, encode
from libbus.wire.messages import (
    Checkpointed,
    Command,
    CommandAck,
    JobLog,
    Message,
    Progress,
    Rendezvous,
    RenewGrant,
    Resolve,
    Resolved,
    SkipJob,
    Task,
)
from libbus.wire.text import cut_json, cut_utf8, json_size
from services.sdnotify import Notifier
from services.usercode import module_allowed, not_allowed

from ..attempt.entry import PRELOAD, run_child
from ..attempt_user import AttemptUser, end_leftovers, job_folder, lend_folder, take_back_folder
from ..channel import LOST, Channel, ChannelClosed
from ..failures import failed_attempt
from .attempt_settings import attempt_settings, ungranted_settings

__all__ = ["AttemptLog", "AttemptRun", "attempt_context", "read_lines", "warm_up"]

log = logging.getLogger(__name__)


def attempt_context() -> multiprocessing.context.ForkServerContext:
    """The context attempts start from (the fork server starts with the first attempt, or with
    :func:`warm_up`)."""
    ctx = multiprocessing.get_context("forkserver")
    assert isinstance(ctx, multiprocessing.context.ForkServerContext)  # noqa: S101 - for the type checker
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def warm_up() -> None:
    """Start the fork server now (a trainer does, on a thread, once it is up), so that its first
    attempt does not wait for it; a failure here shows again, and is reported, at that attempt."""
    attempt_context()
    try:
        multiprocessing.forkserver.ensure_running()
    except Exception as err:  # noqa: BLE001 - the first attempt tries again and fails with the reason
        log.warning("the fork server attempts start from did not start: %s", err)


def resolve(link: Link, dataset: str, settings: Settings, watchdog: Callable[[], object]) -> Resolved:
    """The dataset's providers. None online is waited out for ``provider_wait_s`` (a provider
    restarting), as a loader waits for its lost providers, before the attempt fails."""
    deadline = time.monotonic() + settings.provider_wait_s
    while True:
        try:
            return link.request(Resolve(dataset=dataset), timeout_s=settings.request_timeout_s)
        except NotFound:
            if time.monotonic() >= deadline:
                raise
        watchdog()
        time.sleep(0.25)


#: Most parts of a data-wait split kept per attempt (each a Prometheus label value), and their name's length.
MAX_WAIT_PARTS, MAX_PART_NAME = 32, 64
_PART_NAME = re.compile(r"[A-Za-z0-9_.:-]+")


def wait_parts(split: object) -> dict[str, float]:
    """The ``parts`` of a progress report's ``data_wait_split`` (``libbus.loader.stall``), as the
    trainer exports them: finite, non-negative seconds under at most ``MAX_WAIT_PARTS`` plain names.
    The report comes from the attempt's process, which runs the job's code: anything else is dropped."""
    parts = split.get("parts") if isinstance(split, dict) else None
    if not isinstance(parts, dict):
        return {}
    out: dict[str, float] = {}
    for name, seconds in parts.items():
        if len(out) == MAX_WAIT_PARTS:
            break
        if (
            isinstance(name, str)
            and len(name) <= MAX_PART_NAME
            and _PART_NAME.fullmatch(name)
            and isinstance(seconds, (int, float))
            and not isinstance(seconds, bool)
            and math.isfinite(seconds)
            and seconds >= 0
        ):
            out[name] = float(seconds)
    return out


#: What a child may ask the router, through its trainer: nothing it could not do as the job's trainer.
RELAYED: tuple[type[Message], ...] = (Progress, Checkpointed, CommandAck, Resolve, Rendezvous, SkipJob, RenewGrant)
#: Requests relayed at once (each waits for the router on a thread of its own).
MAX_RELAYS = 8
#: Set-up time an attempt has on top of ``attempt_silence_s`` before its function is called: the
#: interpreter and torch start, the module is imported, a gang meets (RENDEZVOUS_TIMEOUT_S).
SETUP_GRACE_S = 120.0
#: Lines of output quoted in a failed attempt's error, and the most JSON bytes they take there.
TAIL_LINES = 20
TAIL_BYTES = 16 << 10
#: Room left in a message for the result beside the final model's bytes (as the attempt reckons it).
MODEL_HEADROOM = 1 << 20
#: Output lines sent to the router in one message, the most JSON bytes they take (a message is at
#: most 1 MiB: a line of control characters takes 6 bytes a character), and how often they go.
LOG_BATCH = 200
LOG_BATCH_BYTES = 256 << 10
LOG_EVERY_S = 1.0
#: Output kept for the router while it is away (the oldest lines wait; later ones are not sent).
UNSENT_BYTES = 4 << 20
#: The most JSON bytes of a failed attempt's error (its function's exception text is the job's own).
ERROR_BYTES = 64 << 10
#: How long an ended child's channel may stay silent (held open by processes it forked) before
#: the attempt counts as ended without a result.
EXIT_QUIET_S = 2.0
#: Longest output line kept, in bytes of UTF-8: longer ones (a progress bar without newlines, a
#: burst with none) are cut into lines of this size while read, never held whole.
MAX_LINE_BYTES = 4096
#: Longest status line and logger name taken from an attempt.
MAX_STATUS = 200
MAX_LOGGER_NAME = 100
#: Longest wait an attempt may announce (its evaluation's timeout is far below).
MAX_EXTEND_S = 3600.0


def printable(text: str) -> str:
    """``text`` with each unprintable character (a newline, an escape sequence) as ``?``: a status
    line or logger name from an attempt is one line of the trainer's own."""
    return text if text.isprintable() else "".join(c if c.isprintable() else "?" for c in text)


def _seconds(value: object) -> float:
    """An announced wait in seconds, bounded; anything else is none."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return 0.0
    return min(max(float(value), 0.0), MAX_EXTEND_S)


def read_lines(stream: BinaryIO, on_line: Callable[[str], None]) -> None:
    """Each line of ``stream`` (UTF-8, newline dropped) to ``on_line`` until it ends; a line longer
    than :data:`MAX_LINE_BYTES` goes as pieces of at most that many bytes, cut as it is read, never
    held whole (a character split by a cut goes whole into the next piece)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    while raw := stream.readline(MAX_LINE_BYTES - 3):  # the decoder may hold back 3 bytes of a character
        text = decoder.decode(raw)
        on_line(text[:-1] if text.endswith("\n") else text)
    if rest := decoder.decode(b"", final=True):
        on_line(rest)


class AttemptLog:
    """The last ``limit`` bytes of an attempt's output, by line, and the lines not yet sent.

    Sizes are the lines' JSON bytes (what they take in a ``JobLog``), not their characters."""

    def __init__(self, limit: int):
        self.limit = max(1024, limit)
        self.lines: deque[tuple[str, int]] = deque()
        self.size = 0
        self.dropped = 0
        self.unsent: deque[tuple[str, int]] = deque()
        self.unsent_size = 0
        self.lock = threading.Lock()

    def add(self, line: str) -> None:
        line = cut_utf8(line, MAX_LINE_BYTES)
        size = json_size(line) + 1  # and its comma
        with self.lock:
            self.lines.append((line, size))
            self.size += size
            while self.size > self.limit and len(self.lines) > 1:
                self.size -= self.lines.popleft()[1]
                self.dropped += 1
            if self.unsent_size + size <= UNSENT_BYTES:  # the router away for long: bounded
                self.unsent.append((line, size))
                self.unsent_size += size

    def take(self) -> list[str]:
        """The next lines to send: at most :data:`LOG_BATCH` of them, :data:`LOG_BATCH_BYTES` of JSON."""
        out: list[str] = []
        size = 0
        with self.lock:
            while self.unsent and len(out) < LOG_BATCH and size + self.unsent[0][1] <= LOG_BATCH_BYTES:
                line, n = self.unsent.popleft()
                out.append(line)
                size += n
            self.unsent_size -= size
        return out

    def tail(self, n: int = TAIL_LINES, max_bytes: int = TAIL_BYTES) -> list[str]:
        """The last ``n`` lines, fewer where they would take more than ``max_bytes`` of JSON."""
        out: list[str] = []
        size = 0
        with self.lock:
            for line, k in reversed(self.lines):
                if len(out) == n or size + k > max_bytes:
                    break
                out.append(line)
                size += k
        return out[::-1]


class AttemptRun:
    """Runs ``task`` (an entrypoint job or the built-in loop) in a child process and returns
    ``(state, result, error)`` to push to the router."""

    def __init__(
        self,
        task: Task,
        spec: JobSpec,
        settings: Settings,
        link: Link,
        identity: Identity,
        commands: queue.Queue[Command],
        *,
        attempt: int = 0,
        notifier: Notifier | None = None,
        attempt_user: AttemptUser | None = None,
    ):
        self.task = task
        #: The user the attempt's process runs as (the trainer's ``attempt_user``), or None: the trainer's.
        self.attempt_user = attempt_user
        #: ``task``'s spec, parsed where the task entered the trainer (:meth:`TrainerService._run_task`).
        self.spec = spec
        self.settings = settings
        self.link = link
        self.identity = identity
        self.commands = commands
        self.attempt = attempt
        self.notifier = notifier or Notifier()
        self.log = AttemptLog(settings.attempt_log_bytes)
        #: Seconds the attempt's train loader waited for data (its last progress report says).
        self.data_wait_s = 0.0
        #: The same split by part (``stage:NAME``, ``read``, ``transfer``, ``queue``, ``other``), bounded.
        self.data_wait_parts: dict[str, float] = {}
        self.unclean = False
        self.child: multiprocessing.process.BaseProcess | None = None
        self._output: BinaryIO | None = None
        #: Reads the child's output into :attr:`log` until the child (and what it forked) closes it.
        self._output_reader: threading.Thread | None = None
        self.last_checkpoint: dict | None = None
        #: The final model's bytes of a succeeded attempt, as it had them scored (None: it sent none).
        self.final_model: bytes | None = None
        self._result: tuple[str, dict, str] | None = None
        self._relays = threading.BoundedSemaphore(MAX_RELAYS)
        self._log_seq = 0
        self._shipping = threading.Lock()

    # -- the attempt ----------------------------------------------------------------------------
    def run(self) -> tuple[JobState | str, dict, str]:
        spec, s = self.spec, self.settings
        module = spec.entrypoint.partition(":")[0]
        if spec.entrypoint and not module_allowed(module, s.job_modules):
            error = not_allowed(f"entrypoint {spec.entrypoint!r}", module, s.job_modules, "job_modules", "trainer")
            log.error("job %s refused: %s", self.task.job, error)
            return JobState.FAILED, {"retryable": False}, error
        try:
            resolved = resolve(self.link, spec.dataset, s, self.notifier.watchdog)
        except BusError as err:  # no provider online for provider_wait_s, the router away: retried
            return failed_attempt(err, spec)
        provider = pick_provider(resolved.providers, self.identity.host_id)
        folder = job_folder(s.checkpoint_dir, self.task.job)
        if self.attempt_user is not None:
            try:  # its own job's folder, and no other, is the attempt's while it runs
                lend_folder(folder, self.attempt_user)
            except OSError as err:
                why = f"its checkpoint folder {folder} could not be handed to {self.attempt_user.name}: {err}"
                log.error("job %s: %s", self.task.job, why)
                return JobState.FAILED, {"retryable": True}, why
        try:
            return self._run_child(resolved, provider)
        finally:
            if self.attempt_user is not None:  # the attempt and what it left running ended: the trainer's again
                take_back_folder(folder)

    def _run_child(self, resolved: Resolved, provider: dict) -> tuple[JobState | str, dict, str]:
        spec, s = self.spec, self.settings
        parent_end, child_end = socket.socketpair()
        out_read, out_write = socket.socketpair()
        channel = Channel(parent_end.detach())
        try:  # forked from the trainer's fork server, where torch and the trainer's code are imported already
            self.child = attempt_context().Process(
                target=run_child, args=(child_end, out_write), name=f"attempt-{self.task.job}", daemon=False
            )
            with self.notifier.extended(SETUP_GRACE_S):  # the first start also starts the fork server (seconds)
                self.child.start()
        finally:
            child_end.close()
            out_write.close()
        self._output = out_read.makefile("rb")
        out_read.close()
        what = spec.entrypoint or f"the built-in loop ({spec.model})"
        log.info("job %s: attempt %d runs %s in process %d", self.task.job, self.attempt, what, self.child.pid)
        output = self._output_reader = threading.Thread(
            target=self._read_output, name=f"output-{self.task.job}", daemon=True
        )
        output.start()
        done = threading.Event()
        sender = threading.Thread(target=self._send_logs, args=(done,), name=f"logs-{self.task.job}", daemon=True)
        sender.start()
        try:
            channel.send(
                "start",
                [bytes(f.buffer if hasattr(f, "buffer") else f) for f in self.task.frames],  # model_from's weights
                settings=attempt_settings(s) if self.task.grant else ungranted_settings(s, self.task.job),
                grant=self.task.grant,
                task={
                    "job": self.task.job,
                    "spec": self.spec.to_dict(),
                    "rank": self.task.rank,
                    "world_size": self.task.world_size,
                    "resume": self.task.resume,
                    "rendezvous": self.task.rendezvous,
                    "attempt": self.task.attempt,
                    "initial": self.task.initial,
                },
                name=self.identity.name,
                providers=resolved.providers,
                provider_name=provider.get("name", ""),
                attempt=self.attempt,
                attempt_user=self.attempt_user.as_dict() if self.attempt_user is not None else None,
            )
            ended = self._watch(channel)
        finally:
            channel.close()
            self._end_child()
            if self.attempt_user is not None:  # what the attempt forked and left behind (it holds its output)
                end_leftovers(self.attempt_user, attempt_context())
            output.join(timeout=5.0)
            done.set()
            sender.join(timeout=s.request_timeout_s + 1)
        return ended

    def _watch(self, channel: Channel) -> tuple[JobState | str, dict, str]:
        """Relay until the child tells how it ended, ends without telling, hangs or outstays a stop."""
        s = self.settings
        alive_at = time.monotonic()
        activity = None
        stop_by: float | None = None
        stopping = ""
        exited_at = 0.0
        extra_s = 0.0  # a longer wait the attempt announced
        started = False  # set-up (imports, a gang's rendezvous) may take longer than a step
        reader_out: queue.Queue[tuple[dict, list[bytes]] | None] = queue.Queue()
        threading.Thread(target=self._read_channel, args=(channel, reader_out), daemon=True).start()
        while True:
            self.notifier.watchdog()
            try:
                got = reader_out.get(timeout=0.2)
            except queue.Empty:
                pass
            else:
                if got is None:  # the channel closed: the child ended (or closed it)
                    return self._ended_without_result(stopping)
                header, frames = got
                op = header["op"]
                if op == "result":
                    return self._result_of(header, frames)
                if op == "started":
                    started, alive_at = True, time.monotonic()
                if op == "beat":
                    if header.get("activity") != activity:
                        activity, alive_at = header.get("activity"), time.monotonic()
                elif op == "request":
                    alive_at = time.monotonic()
                    self._relay(channel, header, frames)
                elif op == "log":
                    self._log_record(header)
                elif op == "status":
                    self.notifier.status(printable(str(header.get("text", "")))[:MAX_STATUS])
                elif op == "extend":  # a wait the attempt announced (an evaluation): no hang meanwhile
                    extra_s, alive_at = _seconds(header.get("seconds")), time.monotonic()
            while True:  # the router's commands, on to the child
                try:
                    cmd = self.commands.get_nowait()
                except queue.Empty:
                    break
                if cmd.job != self.task.job:
                    continue
                if cmd.command in (JobCommand.STOP, JobCommand.SHUTDOWN) and stop_by is None:
                    stop_by, stopping = time.monotonic() + s.stop_grace_s, str(cmd.command)
                try:
                    channel.send("command", encode(cmd))
                except ChannelClosed:
                    pass
            now = time.monotonic()
            if stop_by is not None and now > stop_by:
                log.warning(
                    "job %s: the attempt did not end %.0f s after %s; killed", self.task.job, s.stop_grace_s, stopping
                )
                self._kill()
                return self._stopped_by_kill(stopping)
            silence = extra_s + (s.attempt_silence_s if started else s.attempt_silence_s + SETUP_GRACE_S)
            if now - alive_at > silence and stop_by is None:
                self._kill()
                return (
                    JobState.FAILED,
                    {"retryable": True},
                    self._failure(
                        f"hung: no job call, batch or report for {s.attempt_silence_s:.0f} s (attempt_silence_s); killed",
                        "a deadlock, or a step longer than attempt_silence_s: call job.step() between steps",
                    ),
                )
            if self.child is not None and self.child.exitcode is not None and reader_out.empty():
                # ended without a word; the channel stays open while processes it forked live on
                exited_at = exited_at or now
                if now - exited_at > EXIT_QUIET_S:
                    return self._ended_without_result(stopping)

    def _read_channel(self, channel: Channel, out: queue.Queue) -> None:
        try:
            while True:
                got = channel.recv()
                if got is not None:
                    out.put(got)
        except ChannelClosed:
            out.put(None)

    def _relay(self, channel: Channel, header: dict, frames: list[bytes]) -> None:
        """One request of the child to the router, answered on a thread of its own."""
        rid = header.get("id", 0)
        try:
            msg = decode(frames)
            if not isinstance(msg, RELAYED) or getattr(msg, "job", self.task.job) != self.task.job:
                raise BusError(f"an attempt may not send {type(msg).__name__} for {getattr(msg, 'job', '')!r}")
            if isinstance(msg, Resolve) and msg.dataset != self.spec.dataset:
                raise BusError(f"an attempt of a job on {self.spec.dataset!r} may not resolve {msg.dataset!r}")
        except BusError as err:
            self._answer(channel, rid, err)
            return
        if isinstance(msg, Checkpointed):
            self.last_checkpoint = msg.checkpoint
        elif isinstance(msg, Progress) and isinstance(msg.progress.get("data_wait_s"), (int, float)):
            self.data_wait_s = float(msg.progress["data_wait_s"])
            self.data_wait_parts = wait_parts(msg.progress.get("data_wait_split"))
        timeout_s = min(float(header.get("timeout_s", 10.0)), 600.0)

        def call() -> None:
            try:
                self._answer(channel, rid, self._deliver(msg, timeout_s))
            except BusError as err:
                self._answer(channel, rid, err)
            finally:
                self._relays.release()

        self._relays.acquire()
        threading.Thread(target=call, daemon=True).start()

    def _deliver(self, msg: Message, timeout_s: float) -> Message:
        """One relayed request to the router; the output so far goes before a checkpoint record and
        before a spike's skip (after which the router takes no more output from this attempt)."""
        if isinstance(msg, (Checkpointed, SkipJob)):
            self._ship_logs()
        return self.link.request(msg, timeout_s=timeout_s)

    def _answer(self, channel: Channel, rid: int, reply: Message | BusError) -> None:
        try:
            if isinstance(reply, BusError):
                code = "PEER_TIMEOUT" if isinstance(reply, PeerTimeout) else reply.code
                channel.send("reply", id=rid, ok=False, code=code, message=str(reply))
            else:
                channel.send("reply", encode(reply), id=rid, ok=True)
        except ChannelClosed:
            pass

    # -- how it ended ---------------------------------------------------------------------------
    def _result_of(self, header: dict, frames: list[bytes]) -> tuple[JobState | str, dict, str]:
        state = str(header.get("state", JobState.FAILED))
        raw = header.get("result")
        result: dict = raw if isinstance(raw, dict) else {}
        error = cut_json(str(header.get("error", "")), ERROR_BYTES)
        if state == JobState.FAILED and error:
            error = self._failure(error, "")
        if state == LOST:
            return LOST, {}, error
        if state == JobState.SUCCEEDED and frames:
            self.final_model = self._model_of(result, frames[0])
        return JobState(state), result, error

    def _model_of(self, result: dict, blob: bytes) -> bytes | None:
        """The final model's bytes the attempt sent (the bytes it had scored), if they are what its
        result names (``model.sha256``) and fit in a message; else None (the router is sent none)."""
        model = result.get("model")
        named = model.get("sha256") if isinstance(model, dict) else None
        if len(blob) > self.settings.max_msg_bytes - MODEL_HEADROOM:
            log.warning("job %s: its final model (%d bytes) does not fit in a message", self.task.job, len(blob))
            return None
        if hashlib.sha256(blob).hexdigest() != named:
            log.warning("job %s: the final model it sent is not the one its result names; not sent", self.task.job)
            return None
        return blob

    def _ended_without_result(self, stopping: str) -> tuple[JobState | str, dict, str]:
        if self.child is not None:
            self.child.join()
        if self._output_reader is not None:  # its last lines (what it printed before dying) go in the error
            self._output_reader.join(EXIT_QUIET_S)
        code = self.child.exitcode if self.child is not None else None
        if stopping:
            return self._stopped_by_kill(stopping)
        if code is not None and code < 0:
            sig = signal.Signals(-code)
            hints = {
                signal.SIGSEGV: "a crash in native code (a C extension, a CUDA kernel, a corrupt tensor)",
                signal.SIGKILL: "killed from outside: most often the kernel's out-of-memory killer "
                "(see dmesg); lower batch_size or what the function holds",
                signal.SIGABRT: "aborted by native code (a failed assertion in a library, a CUDA error)",
                signal.SIGBUS: "a bus error: a shared-memory file shrunk or /dev/shm full",
            }
            how = f"the attempt's process was killed by {sig.name}"
            hint = hints.get(sig, "")
        else:
            how = f"the attempt's process exited with status {code} without a result (os._exit in the function?)"
            hint = "end the function by returning, or raise an exception"
        return JobState.FAILED, {"retryable": True, "exit": code}, self._failure(how, hint)

    def _stopped_by_kill(self, stopping: str) -> tuple[JobState | str, dict, str]:
        result = {"checkpoint": self.last_checkpoint}
        if stopping == JobCommand.SHUTDOWN:
            return JobState.QUEUED, result, "trainer shutting down (the attempt was killed after stop_grace_s)"
        return JobState.STOPPED, result, ""

    def _failure(self, how: str, hint: str) -> str:
        tail = self.log.tail()
        text = how + (f" (hint: {hint})" if hint else "")
        if tail:
            text += "\n--- last lines of its output ---\n" + "\n".join(tail)
        return text

    def _kill(self) -> None:
        if self.child is not None and self.child.exitcode is None:
            self.child.kill()

    def _end_child(self) -> None:
        """The child has sent its result (or is being given up): it exits by itself; kill it if not."""
        if self.child is None:
            return
        self.child.join(timeout=10.0)
        if self.child.exitcode is None:
            self.child.kill()
            self.child.join()

    # -- output ---------------------------------------------------------------------------------
    def _read_output(self) -> None:
        assert self._output is not None  # noqa: S101 - set by run before this starts
        read_lines(self._output, self._output_line)

    def _output_line(self, line: str) -> None:
        self.log.add(line)
        log.info("job %s | %s", self.task.job, line[:500])

    def _log_record(self, header: dict) -> None:
        """A log record of the attempt: logged here under its logger's name and level (bounded: the
        attempt is the job's code), and kept with its output."""
        name, level = header.get("name"), header.get("level")
        if not isinstance(name, str) or not isinstance(level, int) or isinstance(level, bool):
            return
        name, level = printable(name)[:MAX_LOGGER_NAME] or "root", min(max(level, logging.DEBUG), logging.CRITICAL)
        text = cut_utf8(str(header.get("text", "")), MAX_LINE_BYTES)
        for line in text.splitlines() or [""]:
            self.log.add(f"{logging.getLevelName(level)} {name}: {line}")
        if text.startswith(f"job {self.task.job}"):  # the trainer's own code names its job already
            logging.getLogger(name).log(level, "%s", text)
        else:
            logging.getLogger(name).log(level, "job %s: %s", self.task.job, text)

    def _send_logs(self, done: threading.Event) -> None:
        """The output's new lines to the router every ``LOG_EVERY_S`` and at the end."""
        while True:
            finished = done.wait(LOG_EVERY_S)
            self._ship_logs()
            if finished:
                return

    def _ship_logs(self) -> None:
        """Send the lines not sent yet, in order (also before a checkpoint record is relayed, so the
        output up to a checkpoint outlives a trainer killed right after it)."""
        if self.task.rank > 0:  # rank 0's output stands for the gang's (the router holds the job by it)
            return
        with self._shipping:
            while lines := self.log.take():
                try:
                    self.link.request(
                        JobLog(job=self.task.job, attempt=self.attempt, seq=self._log_seq, lines=lines),
                        timeout_s=self.settings.request_timeout_s,
                    )
                except BusError as err:
                    log.debug("job %s: output lines not stored: %s", self.task.job, err)
                self._log_seq += len(lines)
