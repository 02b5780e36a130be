"""What the trainer service hands an attempt's process: its settings without the trainer's credentials,
and a trainer whose memory an attempt of its uid cannot read (docs/security.md §4.1).

The attempt's own side of the grant (:class:`~services.trainer.grant.GrantSource`, the environment
withheld) is in :mod:`services.trainer.grant`, which both processes share; this module reads the
trainer's token (:func:`ungranted_settings`) and stays on the service's side of the process boundary.
"""

from __future__ import annotations

import ctypes
import logging

from libbus.config import Settings

from ... import credentials
from ..grant import WITHHELD_SETTINGS

__all__ = ["attempt_settings", "not_dumpable", "ungranted_settings"]

log = logging.getLogger(__name__)

_PR_SET_DUMPABLE = 4


def attempt_settings(settings: Settings) -> dict:
    """``settings`` as the attempt's process is given them: its trainer's credentials withheld."""
    return {**settings.as_dict(), **WITHHELD_SETTINGS}


def ungranted_settings(settings: Settings, job: str) -> dict:
    """``settings`` as an attempt is given them when its task carries no grant (the router holds no signing
    key, as on a cluster whose nodes hold only the public key): its trainer's own token, as before grants
    existed, said loudly, since the job's code can then act as its trainer (docs/security.md §4.1)."""
    log.warning(
        "job %s: the router sent no grant with this task (it holds no signing key to mint one); its attempt "
        "reads with this trainer's own token, so its code can act as this trainer: keep the cluster's signing "
        "key on the router's machine to give each attempt only its job's grant",
        job,
    )
    token = credentials.token_source(settings, "trainer", credentials.service_name(settings, "trainer"))
    return {**settings.as_dict(), "token": token() if callable(token) else token}


def not_dumpable() -> bool:
    """Make this process not dumpable (``PR_SET_DUMPABLE`` 0): a process of the same uid that is not
    privileged (an attempt) can then read neither its memory nor its environment in ``/proc``, nor
    trace it. (No core dumps of it; a debugger must run as root.) False where that is not Linux."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
