"""Imported by the trainer's fork server only (:data:`.entry.PRELOAD`), never by the trainer.

The fork server is the process every attempt is forked from (multiprocessing's ``forkserver``): it
imports the trainer's code and torch once, so an attempt starts in milliseconds. It must outlive a
``SIGTERM`` sent to the trainer's whole process group (Slurm's ``scancel`` and preemption signal every
process of a step; a terminal's Ctrl-C the foreground group), because its attempts die with it
(``PR_SET_PDEATHSIG``) — before the trainer could ask them to checkpoint. The trainer decides when its
attempts end; the fork server ends when the trainer does: it reads EOF on its ``alive`` pipe once no
process holds the pipe's write end, and only the trainer does (:func:`leave_alive_pipe`), so a trainer
killed with SIGKILL takes its fork server, and with it every attempt, however stuck.

Not ``PR_SET_PDEATHSIG`` here: the kernel sends it when the *thread* that forked the process ends, and
the trainer starts its fork server from a short-lived thread (``warm_up``) or an attempt's runner, so
the fork server would be killed under a trainer that lives on.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
from multiprocessing import forkserver

# torch.optim imports torch._dynamo the first time an optimizer is made: about a second of CPU that
# every attempt paid again (each is a fresh fork). Imported here once, it is in every attempt already.
# (It starts no thread: forking after it is as safe as after torch itself.)
import torch._dynamo  # noqa: F401 - see above

from . import child  # noqa: F401 - imported here once, for every attempt forked after

__all__ = ["leave_alive_pipe"]

signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)


def _end_now() -> None:
    """The fork server's end, once its trainer is gone: no interpreter teardown. Tearing down torch took
    2.5-5 s on a loaded machine, seconds in which the fork server outlived its trainer. (Registered last,
    this runs first at exit; its attempts, forks of it, end through ``os._exit`` and never run it.)"""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader gone
            pass
    os._exit(0)


atexit.register(_end_now)


def leave_alive_pipe() -> None:
    """In an attempt, as it starts: close its copy of the write end of the fork server's ``alive`` pipe.

    multiprocessing hands every process it forks that end (for processes that would start others through
    the same fork server), and the fork server reads EOF only when the last copy closes: an attempt stuck
    where none of its threads runs (a C call holding the GIL, a hung collective) kept its fork server, and
    so itself, alive after a ``kill -9`` of their trainer, both re-parented to PID 1. An attempt starts no
    process through the trainer's fork server (one that asked would start a fork server of its own).
    """
    server = forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is None:
        return
    server._forkserver_alive_fd = None  # type: ignore[attr-defined]  # multiprocessing's own, not in typeshed
    try:
        os.close(fd)
    except OSError:  # closed already: nothing holds it here
        pass
