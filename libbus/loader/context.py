"""The ZeroMQ context a loader's sockets live in: one per process, whose I/O threads never preempt
the training loop.

Every request a loader sends wakes its context's I/O thread, which writes it out and so wakes the
provider. On a machine with no idle core, a woken thread of the default policy preempts the thread
that woke it: the training loop, inside ``next()``, for as long as the I/O thread and whatever it
wakes run there. With the I/O threads on ``SCHED_BATCH`` a wake-up never preempts: the request goes
out from a free core, or when the loop's time slice ends; the batch it asks for is ``inflight``
steps away, so that costs nothing. ``busctl bench --wait`` measured the trainer loop's wait at 20 ms
per step going from 5.9% to 3.7% (median of six alternated blocks, one run on a loaded 2-core VM),
with the loader's samples/s unchanged (docs/performance.md).

The loader does not change the process-wide ``zmq.Context.instance()`` a script may use for its own
sockets; it makes a context of its own, the first time a loader needs one in this process.
"""

from __future__ import annotations

import logging
import os
import threading

import zmq

__all__ = ["loader_context", "yield_to_the_loop"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_context: zmq.Context | None = None
_pid = 0


def loader_context() -> zmq.Context:
    """The process's loader context (a new one after a fork), its I/O threads on ``SCHED_BATCH``
    where this process may set that policy (else the default policy, with a debug line saying why)."""
    global _context, _pid
    with _lock:
        if _context is None or _context.closed or _pid != os.getpid():
            ctx = zmq.Context()
            if _batch_policy_allowed():
                # libzmq sets the policy in each I/O thread as it starts (and aborts if refused:
                # hence the probe), so this comes before the context's first socket.
                ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
            _context, _pid = ctx, os.getpid()
        return _context


def _batch_policy_allowed() -> bool:
    """Whether a thread of this process may move itself to ``SCHED_BATCH`` (tried on a thread of
    its own, which ends right after)."""
    if not hasattr(os, "SCHED_BATCH") or not hasattr(os, "sched_setscheduler"):
        return False
    allowed: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            allowed.append(True)
        except OSError as err:
            log.debug("loader I/O threads keep the default scheduling policy: %s", err)

    thread = threading.Thread(target=probe, name="batchbus-sched-probe", daemon=True)
    thread.start()
    thread.join()
    return bool(allowed)


def yield_to_the_loop() -> None:
    """Move the calling thread (a pass's own, :mod:`libbus.loader.handoff`) to ``SCHED_BATCH`` where
    this process may: woken by the loop's ``next()``, it then runs on a free core or when the loop's
    time slice ends, never preempting the loop, as the I/O threads above. Else it keeps its policy."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError) as err:
        log.debug("a loader's pass thread keeps the default scheduling policy: %s", err)
