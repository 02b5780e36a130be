"""Imported by the trainer's fork server only (:data:`.attempt.PRELOAD`), never by the trainer.

The fork server is the process every attempt is forked from (multiprocessing's ``forkserver``): it
imports the trainer's code and torch once, so an attempt starts in milliseconds. It must outlive a
``SIGTERM`` sent to the trainer's whole process group (Slurm's ``scancel`` and preemption signal every
process of a step; a terminal's Ctrl-C the foreground group), because its attempts die with it
(``PR_SET_PDEATHSIG``) — before the trainer could ask them to checkpoint. The trainer decides when its
attempts end; the fork server ends when the trainer does (it reads EOF on its ``alive`` pipe).
"""

from __future__ import annotations

import signal

from . import child  # noqa: F401 - imported here once, for every attempt forked after

signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
