"""A task's reports to the router (progress, checkpoint records, command acknowledgements), sent in
order from their own thread so that training never waits on the router.

While the router is away the reports wait in a bounded buffer (the oldest progress reports are
dropped first; checkpoint records and acknowledgements are kept) and are delivered, in order, when
it is back. The router's answers are turned into flags the training loop reads between batches:
``stop_requested`` (a stop whose push was lost), commands not yet acknowledged (handed to
``on_command``) and ``lost`` (the router gave the job to someone
else: abandon it).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from libbus.connect.link import Link
from libbus.errors import BusError, Forbidden, PeerTimeout
from libbus.wire.messages import Checkpointed, Command, Message, Progress

__all__ = ["Reporter"]

log = logging.getLogger(__name__)

#: Reports buffered while the router is away.
BUFFER = 1000
#: Pause between tries while the router does not answer.
RETRY_S = 0.2
#: The longest an epoch's report waits for the router's verdict on it (early stopping, a study's
#: pruner), which rides on the reply, so that the verdict applies at that report, not an epoch
#: later. A router away does not hold training up that long: one unanswered try ends the wait.
VERDICT_WAIT_S = 60.0


class Reporter:
    """Delivers one job's reports in order. ``put`` never blocks; ``flush`` waits (bounded)."""

    def __init__(
        self, link: Link, job: str, timeout_s: float, on_command: Callable[[Command], None] = lambda cmd: None
    ):
        self.link = link
        self.job = job
        self.on_command = on_command
        self.timeout_s = timeout_s
        self.stop_requested = threading.Event()
        #: Why the router refused this trainer the job (it is someone else's now), else None.
        self.lost: BusError | None = None
        #: Step of the last checkpoint record the router took (None before the first).
        self.checkpoint_step: int | None = None
        #: The report being delivered (sent, perhaps taken, not answered yet): reports go one at a time.
        self._trying: Message | None = None
        #: Reports delivered and reports dropped from a full buffer.
        self.sent = 0
        self.dropped = 0
        self._queue: deque[Message] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False
        #: Tries to deliver a report that went unanswered (the router away or slow), ever.
        self._unanswered = 0
        self._thread = threading.Thread(target=self._run, name=f"reports-{job}", daemon=True)
        self._thread.start()

    def put(self, msg: Message) -> None:
        with self._cond:
            if len(self._queue) >= BUFFER:
                drop = next((m for m in self._queue if isinstance(m, Progress)), None)
                if drop is not None:
                    self._queue.remove(drop)
                    self.dropped += 1
            self._queue.append(msg)
            self._cond.notify_all()

    def held_steps(self) -> set[int | None]:
        """The steps of the checkpoint records the router may hold: the last it acknowledged, and
        the one being delivered (the router may have stored it and its answer not come back: a
        trainer killed in between). No later record has been sent."""
        with self._cond:
            return self._held()

    def _held(self) -> set[int | None]:
        held = {self.checkpoint_step}
        if isinstance(self._trying, Checkpointed):
            held.add(self._trying.checkpoint["step"])
        return held

    def prune_checkpoints(self, prune: Callable[[set[int | None]], object]) -> None:
        """Remove the checkpoint files the router cannot come to hold: ``prune(held)`` removes all but
        the last few and those of ``held``, which is :meth:`held_steps` and the steps of the records
        still waiting here to be sent (each may be the one the router holds when this trainer dies).
        Under this reporter's lock, so that no record starts being sent in between. A record queued
        behind a slow delivery used to lose its file before it was sent: a trainer killed right after
        the router took it left its job nothing to resume from."""
        with self._cond:
            held = self._held()
            held.update(m.checkpoint["step"] for m in self._queue if isinstance(m, Checkpointed))
            prune(held)

    @property
    def pending(self) -> int:
        """Reports not delivered yet."""
        return len(self._queue)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every report is delivered (True), the job is lost, or ``timeout_s`` passes."""
        with self._cond:
            return self._cond.wait_for(lambda: (not self._queue and not self._busy) or self.lost is not None, timeout_s)

    def await_verdict(self) -> bool:
        """Wait until the reports so far (an epoch's last) are answered, the router's verdict on them
        with them (handed to ``on_command`` before this returns). False, logged, when a try to deliver
        them goes unanswered (the router is away: training does not wait for it) or after
        :data:`VERDICT_WAIT_S`: training goes on, and the verdict applies when it comes."""
        with self._cond:
            failed_before = self._unanswered
            answered = self._cond.wait_for(
                lambda: (
                    (not self._queue and not self._busy) or self.lost is not None or self._unanswered > failed_before
                ),
                VERDICT_WAIT_S,
            )
            if answered and self._unanswered == failed_before:
                return True
        log.warning(
            "job %s: the router has not answered this epoch's report; training goes on, and its verdict "
            "(early stopping, a study's pruner) applies when it comes",
            self.job,
        )
        return False

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(self.timeout_s + 2.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue or self.lost is not None:
                    self._busy = False
                    self._cond.notify_all()
                    if self._closed:
                        return
                    self._cond.wait(RETRY_S)
                    continue
                msg = self._queue[0]
                self._busy = True
                self._trying = msg  # from here the router may hold it, until it answers
            delivered = self._send(msg)
            with self._cond:
                if delivered and self._queue and self._queue[0] is msg:
                    self._queue.popleft()
                    self.sent += 1
                    if isinstance(msg, Checkpointed) and self.lost is None:
                        self.checkpoint_step = msg.checkpoint["step"]
                if delivered:
                    self._trying = None
                self._busy = False
                self._cond.notify_all()
                if self._closed and not delivered:
                    return  # closing with the router away: what is left is given up
            if not delivered:
                with self._cond:
                    self._unanswered += 1
                    self._cond.notify_all()
                threading.Event().wait(RETRY_S)

    def _send(self, msg: Message) -> bool:
        """True once ``msg`` is answered (or refused for good); False to try again later."""
        msg.id = 0
        try:
            reply = self.link.request(msg, timeout_s=self.timeout_s)
        except PeerTimeout:
            return False
        except Forbidden as err:
            log.warning("job %s: router refused %s: %s", self.job, msg.type, err)
            self.lost = err
            return True
        except BusError as err:
            if self.link.fatal is not None:
                self.lost = err
                return True
            log.error("job %s: router rejected %s: %s", self.job, msg.type, err)
            return True  # a report the router cannot take is not retried
        detail = getattr(reply, "detail", {})
        for cmd in detail.get("commands", ()):  # repeated until acknowledged: their pushes may be lost
            self.on_command(Command(job=self.job, command=cmd["command"], args=cmd["args"], seq=cmd["seq"]))
        if detail.get("stop"):  # after the commands: a stop among them is acknowledged, not just obeyed
            self.stop_requested.set()
        return True
