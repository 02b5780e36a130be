"""Where an attempt's process starts: the one module of this folder the trainer service imports (it
names :func:`run_child` as the child's target). It imports nothing else, and torch only in the child:
the fork server has :mod:`.child` imported already (``PRELOAD``)."""

from __future__ import annotations

import socket

__all__ = ["PRELOAD", "run_child"]

#: Modules imported once into the trainer's fork server (multiprocessing's ``forkserver``): each
#: attempt is a fork of it that starts in milliseconds, with torch and the trainer's code imported,
#: instead of a new interpreter importing them again (seconds).
PRELOAD = ["services.trainer.attempt.forkserver"]


def run_child(channel_end: socket.socket, output: socket.socket) -> None:
    """An attempt's process (the target the fork server runs): :func:`.child.child_main`, imported
    there already (:data:`PRELOAD`). The trainer never imports it, nor torch: it only relays."""
    from .child import child_main
    from .forkserver import leave_alive_pipe

    leave_alive_pipe()  # the fork server then ends with the trainer, taking this attempt with it
    child_main(channel_end, output)
