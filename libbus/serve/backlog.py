"""Replies a peer has not taken yet, bounded in bytes per connection.

libzmq bounds a peer's queue of unsent replies by its high-water mark, which counts messages
(1000), not bytes: a reader that sends many ``BatchRequest`` and never reads would make a provider
hold 1000 batches of up to 128 MiB each. A server cannot see inside that queue, but it can see
when each reply leaves it: :func:`libbus.wire.sockets.send_tracked` sends one frame of a reply zero-copy
and watched (:class:`~libbus.wire.sockets.SentTracker`); libzmq releases a frame once it is written to
the kernel, frames in order (a peer that does not read fills its TCP window, and then nothing
more is written). So per connection the server knows, exactly and without the peer's word, how many
bytes of replies it still holds.

Replies being worked on off the serving loop (a provider reads batches on lanes) count before they
exist, by the size their handler expects (``Future.expected_bytes``): otherwise a peer's requests would
all go to work at once and their replies be held together, past the budget.

When that is over the budget (``session_unsent_bytes``), the connection's next requests wait (in
order, counted against ``session_inflight``) and are served as soon as the backlog drains under
the budget; one that waits longer than ``unsent_wait_s`` is refused RATE_LIMITED with the figures.
A reader that reads is never slowed beyond its own pace; one that does not read costs at most
the budget, plus the one reply that crossed it, plus ``HWM`` replies too small to be tracked, plus
one reply's small copied frames behind its watched one.

The ledger is kept per connection (ZeroMQ routing id), not per session: a new ``Hello`` on the same
connection does not make the bytes queued on it disappear. No wire change: old and new clients
are bounded alike.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypedDict

from libbus.constants import MiB
from libbus.errors import RateLimited
from libbus.serve.sessions import Session
from libbus.wire.messages import Message
from libbus.wire.sockets import SentTracker

__all__ = ["Backlog", "BacklogStats", "Backlogs"]


@dataclass
class Backlog:
    """One connection's replies not yet written out, and its requests waiting for them to go."""

    #: ``(tracker, bytes)`` of each tracked reply still held, oldest first (a connection's replies
    #: leave in order).
    held: deque = field(default_factory=deque)
    unsent: int = 0
    #: ``(deadline, session, request)`` waiting for the backlog to drain, in arrival order.
    waiting: deque = field(default_factory=deque)
    #: Bytes the replies being worked on off the serving loop will add (as their handler expects).
    working: int = 0

    def expected(self) -> int:
        """The bytes held, plus those the requests being worked on will add."""
        return self.settle() + self.working

    def settle(self) -> int:
        """Forget the replies that have left; returns the bytes still held."""
        held = self.held
        while held and held[0][0].done:
            self.unsent -= held.popleft()[1]
        return self.unsent


class BacklogStats(TypedDict):
    """A server's backlog figures (its ``Stats`` row's ``backlog``)."""

    #: Bytes of replies handed to libzmq and not yet written to the kernel, over all connections.
    unsent_bytes: int
    #: Requests waiting now for their connection's backlog to drain.
    waiting_for_reads: int
    #: Requests that have waited so, since the start.
    deferred_for_reads: int
    #: Requests refused RATE_LIMITED after waiting too long, since the start.
    refused_unread: int


class Backlogs:
    """The ledgers of one server's connections, keyed by routing id."""

    def __init__(self, budget: int, wait_s: float):
        self.budget = budget
        self.wait_s = wait_s
        self._by_routing: dict[bytes, Backlog] = {}
        self.deferred = 0
        self.refused = 0

    def track(self, routing_id: bytes, tracker: SentTracker, nbytes: int) -> None:
        """A reply of ``nbytes`` was handed to libzmq for ``routing_id``."""
        if self.budget <= 0:
            return
        backlog = self._by_routing.get(routing_id)
        if backlog is None:
            backlog = self._by_routing[routing_id] = Backlog()
        backlog.held.append((tracker, nbytes))
        backlog.unsent += nbytes

    def started(self, routing_id: bytes, nbytes: int) -> None:
        """A request of ``routing_id`` went to work off the loop; its reply will be about ``nbytes``."""
        if self.budget <= 0 or nbytes <= 0:
            return
        backlog = self._by_routing.get(routing_id)
        if backlog is None:
            backlog = self._by_routing[routing_id] = Backlog()
        backlog.working += nbytes

    def finished(self, routing_id: bytes, nbytes: int) -> None:
        """That work ended (its reply is being sent, or it failed)."""
        backlog = self._by_routing.get(routing_id)
        if backlog is not None and nbytes > 0:
            backlog.working = max(0, backlog.working - nbytes)

    def unsent(self, routing_id: bytes) -> int:
        backlog = self._by_routing.get(routing_id)
        return 0 if backlog is None else backlog.settle()

    def must_wait(self, routing_id: bytes) -> bool:
        """Whether a request of this connection must wait: requests already wait (order is kept),
        or more than the budget of its replies is still held."""
        backlog = self._by_routing.get(routing_id)
        if backlog is None:
            return False
        return bool(backlog.waiting) or backlog.expected() > self.budget

    def defer(self, routing_id: bytes, session: Session, msg: Message, now: float) -> None:
        self._by_routing[routing_id].waiting.append((now + self.wait_s, session, msg))
        self.deferred += 1

    @property
    def waiting(self) -> int:
        return sum(len(b.waiting) for b in list(self._by_routing.values()))

    def release(self, now: float, serve: Callable[[Session, Message, RateLimited | None], None]) -> None:
        """Serve the waiting requests whose connection is back under the budget (``serve(session,
        msg, None)``), refuse those that waited ``wait_s`` (``serve(session, msg, error)``), and
        forget connections with nothing held and nothing waiting."""
        for routing_id, backlog in list(self._by_routing.items()):
            while backlog.waiting:
                deadline, session, msg = backlog.waiting[0]
                if backlog.expected() <= self.budget:
                    backlog.waiting.popleft()
                    serve(session, msg, None)  # its reply may put the connection over again
                elif now > deadline:
                    backlog.waiting.popleft()
                    self.refused += 1
                    serve(session, msg, self.refusal(backlog.unsent))
                else:
                    break
            if not backlog.waiting and not backlog.settle() and not backlog.working:
                del self._by_routing[routing_id]

    def refusal(self, unsent: int) -> RateLimited:
        return RateLimited(
            f"{unsent / MiB:.1f} MiB of replies to this connection are still unread (the peer is not "
            f"reading them); at most {self.budget / MiB:.0f} MiB (session_unsent_bytes) are held for a "
            f"connection, and this request waited {self.wait_s:g} s for them to drain: read replies "
            "before sending more requests"
        )

    def drop_waiting(self, routing_id: bytes, session: Session) -> list[Message]:
        """Take the waiting requests of a session that closed; returns them."""
        backlog = self._by_routing.get(routing_id)
        if backlog is None:
            return []
        mine = [m for _, s, m in backlog.waiting if s is session]
        backlog.waiting = deque(w for w in backlog.waiting if w[1] is not session)
        return mine

    def take_all_waiting(self) -> list[tuple[Session, Message]]:
        out = [(s, m) for b in self._by_routing.values() for _, s, m in b.waiting]
        for b in self._by_routing.values():
            b.waiting.clear()
        return out

    def stats(self) -> BacklogStats:
        """The ledgers' figures, read without changing them: heartbeats and metric scrapes call this
        from threads of their own while the serving loop settles and extends the ledgers (the bytes
        are those held at the loop's last look, a turn old at most)."""
        backlogs = list(self._by_routing.values())  # one C-level copy: no loop change in between
        return {
            "unsent_bytes": sum(b.unsent for b in backlogs),
            "waiting_for_reads": self.waiting,
            "deferred_for_reads": self.deferred,
            "refused_unread": self.refused,
        }
