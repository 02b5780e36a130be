"""What an attempt's process holds: its job's grant, and nothing that authenticates as its trainer.

An attempt runs the job's code (a tenant's ``entrypoint``). The router mints, with each task, an
``attempt`` token scoped to that job and its dataset (``Task.grant``): the attempt reads its batches and
has its models scored with it, and the router opens no session for it (its reports go through its
trainer, which relays only its own job's). Its trainer withholds the rest:

- :func:`~.service.attempt_settings.attempt_settings`: the settings the attempt is given, without
  ``token``, ``token_file``, the HS256 ``secret_file`` or the EdDSA ``signing_key_file`` (those two point
  at :data:`WITHHELD`, a path that cannot exist), and :func:`~.service.attempt_settings.not_dumpable`:
  the trainer's memory and environment are not readable through ``/proc`` by a process of its uid (both
  the service's: this module is what both processes share);
- :func:`withhold_environment`: the trainer drops the variables that name or hold a credential
  (:data:`CREDENTIAL_VARIABLES`) from its own environment before its fork server starts (an attempt is
  a fork of it, and reads ``/proc/self/environ`` and its parent's), and the attempt again from its own;
- :class:`GrantSource`: the attempt's token, renewed through its trainer (``RenewGrant``, which the
  router answers only while the trainer holds the job) once half its life is spent.

What a trainer still trusts its jobs with is in docs/security.md §4.1.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, MutableMapping

from libbus.config import ENV_PREFIX
from libbus.errors import AuthInvalid, BusError, ConfigError
from libbus.security.auth import inspect_token
from libbus.wire.messages import Grant, RenewGrant

__all__ = ["CREDENTIAL_VARIABLES", "WITHHELD", "WITHHELD_SETTINGS", "GrantSource", "withhold_environment"]

log = logging.getLogger(__name__)

#: Where an attempt's settings point a withheld key file: under ``/dev/null``, which is no directory.
WITHHELD = "/dev/null/withheld-from-attempts"
#: Settings an attempt never sees, and what it sees instead.
WITHHELD_SETTINGS = {"token": "", "token_file": "", "secret_file": WITHHELD, "signing_key_file": WITHHELD}
#: Environment variables that hold a credential or name one: the settings above, the config file
#: (it may hold ``token``), and systemd's credentials folder (``token``, ``secret``: libbus/config.py
#: CREDENTIALS).
CREDENTIAL_VARIABLES = (
    *(ENV_PREFIX + name.upper() for name in WITHHELD_SETTINGS),
    ENV_PREFIX + "CONFIG",
    "CREDENTIALS_DIRECTORY",
)


def withhold_environment(env: MutableMapping[str, str]) -> list[str]:
    """Remove :data:`CREDENTIAL_VARIABLES` from ``env`` (``os.environ`` at a process's entry point);
    returns the names removed. For ``os.environ`` the variables' text is also overwritten where the
    process started with it (what ``/proc/PID/environ`` shows: removing a variable leaves it there)."""
    removed = [name for name in CREDENTIAL_VARIABLES if name in env]
    if removed and env is os.environ:
        _wipe_initial_environment(removed)
    for name in removed:
        del env[name]
    return removed


def _wipe_initial_environment(names: list[str]) -> None:
    """Overwrite ``NAME=value`` of each of ``names`` with zeros in the C environment (the block the
    kernel shows in ``/proc/PID/environ``), before the variables are removed."""
    try:
        libc = ctypes.CDLL(None)
        environ = ctypes.POINTER(ctypes.c_void_p).in_dll(libc, "environ")
    except (OSError, ValueError, AttributeError):
        return
    prefixes = tuple(f"{name}=".encode() for name in names)
    i = 0
    while environ[i]:
        address = environ[i]
        entry = ctypes.string_at(address)
        if entry.startswith(prefixes):
            ctypes.memset(address, 0, len(entry))  # the kernel's view ends at the first NUL of each entry
        i += 1


class GrantSource:
    """The attempt's token as a callable (an :class:`~libbus.connect.client.Identity` token): the
    task's grant, renewed by ``renew`` (a ``RenewGrant`` through the trainer) once half of its life is
    spent. A failed renewal keeps the grant it has (the providers refuse it once it expires).

    Raises:
        ConfigError: the task carries no grant (the router holds no signing key), or not an attempt's.
    """

    def __init__(self, job: str, grant: str, renew: Callable[[RenewGrant], Grant]):
        if not grant:
            raise ConfigError(
                f"job {job}: the router sent no grant with this task (it mints them with the cluster's signing "
                "key, which it does not hold); an attempt is never given its trainer's token"
            )
        self.job = job
        self._renew = renew
        self._lock = threading.Lock()
        self._token, self._renew_at = self._check(grant)

    def _check(self, token: str) -> tuple[str, float]:
        try:
            _, claims = inspect_token(token)
        except AuthInvalid as err:
            raise ConfigError(f"job {self.job}: its grant is not a token: {err}") from err
        if claims.get("role") != "attempt" or claims.get("jobs") != [self.job]:
            raise ConfigError(f"job {self.job}: its grant is not an attempt's token for this job")
        iat, exp = float(claims.get("iat", 0)), float(claims.get("exp", 0))
        return token, iat + (exp - iat) / 2

    def __call__(self) -> str:
        with self._lock:
            if time.time() >= self._renew_at:
                try:
                    self._token, self._renew_at = self._check(self._renew(RenewGrant(job=self.job)).token)
                except (BusError, ConfigError) as err:
                    log.warning("job %s: its grant was not renewed: %s", self.job, err)
                    self._renew_at = time.time() + 30.0  # asked again later, not at every call
            return self._token
