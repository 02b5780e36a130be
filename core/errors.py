"""The root of batchbus's exception tree, on the ground floor: every layer may import it, and it
imports nothing. :mod:`libbus.errors` re-exports both classes with the rest of the tree (the wire codes),
so callers import errors from there; :mod:`shm`, below libbus, imports its :class:`ShmError` from here.
"""

from __future__ import annotations

__all__ = ["BusError", "ShmError"]


class BusError(Exception):
    """Root of every batchbus error. ``code`` is the stable wire code sent in ``Error`` replies."""

    code = "INTERNAL"

    def __init__(self, message: str = "", *, code: str | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return self.message or self.code


class ShmError(BusError):
    """Shared memory could not be created, attached or validated."""

    code = "INTERNAL"
