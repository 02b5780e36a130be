"""The job schema: a job's spec with its validation, the states a job moves through, and the commands
that move it.

This face re-exports every submodule's ``__all__``; inside libbus, import the submodule itself."""

from __future__ import annotations

from libbus.jobs import commands as _commands
from libbus.jobs import spec as _spec
from libbus.jobs import state as _state
from libbus.jobs.commands import *  # noqa: F403
from libbus.jobs.spec import *  # noqa: F403
from libbus.jobs.state import *  # noqa: F403

__all__ = [*_commands.__all__, *_spec.__all__, *_state.__all__]
