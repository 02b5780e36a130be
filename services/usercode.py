"""Code a job names, imported only where the node's operator allowed it.

A job spec comes from the wire: whoever can submit a job chooses its ``model`` string. Importing any
module it names would run that module's top level on the trainer (``pydoc:pipepager`` with a crafted
``model_kwargs`` runs a shell command), so what may run on a node is the operator's decision, not the
job's: a ``package.module:name`` reference is resolved only if ``module`` is listed, by its exact name, in
the node's ``user_modules`` setting. Nothing is imported before that check.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection

from libbus.errors import BadRequest

__all__ = ["import_allowed"]


def import_allowed(ref: str, allowed: Collection[str], what: str) -> object:
    """The attribute ``name`` of ``module`` for ``ref`` = ``"module:name"``, if ``module`` is in ``allowed``.

    ``what`` names the reference in messages (``"model 'pkg.mod:build'"``).

    Raises:
        BadRequest: a malformed reference, a module the node does not allow (named with the setting
            to change; nothing is imported then), or one that cannot be imported or lacks ``name``.
    """
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr.isidentifier() or attr.startswith("_"):
        raise BadRequest(f"{what}: give package.module:name (a public name), got {ref!r}")
    if module_name not in allowed:
        listed = ", ".join(sorted(allowed)) or "none"
        raise BadRequest(
            f"{what}: module {module_name!r} is not in this node's user_modules ({listed}); only modules its "
            "operator lists there (its config file or BATCHBUS_USER_MODULES) may run, nothing was imported"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise BadRequest(f"{what}: cannot import {module_name!r}: {err}") from err
    try:
        return getattr(module, attr)
    except AttributeError as err:
        raise BadRequest(f"{what}: {module_name} has no {attr!r}") from err
