"""The root of batchbus's exception tree, in the lowest layer that raises it: :mod:`shm` sits below
libbus and imports nothing of the project, so the root lives here with shm's own error.
:mod:`libbus.errors` re-exports both with the rest of the tree (the wire codes), and everything above
shm imports errors from there.
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
