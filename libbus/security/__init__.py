"""Who may speak: JWT issue and check, CURVE keys, admission of connections before they authenticate.

This face re-exports every submodule's ``__all__``; inside libbus, import the submodule itself."""

from __future__ import annotations

from libbus.security import admission as _admission
from libbus.security import auth as _auth
from libbus.security import curve as _curve
from libbus.security import tokencheck as _tokencheck
from libbus.security.admission import *  # noqa: F403
from libbus.security.auth import *  # noqa: F403
from libbus.security.curve import *  # noqa: F403
from libbus.security.tokencheck import *  # noqa: F403

__all__ = [*_admission.__all__, *_auth.__all__, *_curve.__all__, *_tokencheck.__all__]
