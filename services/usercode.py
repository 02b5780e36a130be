"""Code a job names, imported only where the node's operator allowed it.

A job spec comes from the wire: whoever can submit a job chooses its ``model`` string. Importing any
module it names would run that module's top level on the trainer (``pydoc:pipepager`` with a crafted
``model_kwargs`` runs a shell command), so what may run on a node is the operator's decision, not the
job's: a ``package.module:name`` reference is resolved only if ``module`` is allowed by the node's
setting — ``job_modules`` on a trainer (entrypoints and ``module:factory`` models), ``user_modules`` on a
provider (pipeline ``user`` stages; ``evaluator_modules`` for its evaluators). An entry allows that module by its exact name; an entry ending in
``.`` or ``.*`` (``mylab.`` / ``mylab.*``) allows every module under that package. Nothing is imported
before that check.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from collections.abc import Collection

from libbus.errors import BadRequest

__all__ = ["closest_allowed", "import_allowed", "module_allowed", "not_allowed"]


def module_allowed(module_name: str, allowed: Collection[str]) -> bool:
    """Whether ``allowed`` lists ``module_name``, or a package prefix of it (``pkg.`` or ``pkg.*``)."""
    for entry in allowed:
        prefix = entry.removesuffix("*")
        if entry == module_name or (prefix.endswith(".") and module_name.startswith(prefix)):
            return True
    return False


def not_allowed(what: str, module_name: str, allowed: Collection[str], setting: str, node: str = "node") -> str:
    """The refusal of ``module_name`` (not in ``allowed``, the node's ``setting``): first the allowed
    module it is a likely typo of ("did you mean"), then what its operator would list to allow it:
    the module itself, or its package with a trailing ``.``."""
    listed = ", ".join(sorted(allowed)) or "none"
    package = module_name.rpartition(".")[0]
    entry = f"{module_name!r}" + (f", or {package + '.'!r} for every module of its package" if package else "")
    meant = closest_allowed(module_name, allowed)
    typo = f"Did you mean {meant!r}? (then fix the name where the job gives it and submit it again) " if meant else ""
    return (
        f"{what}: module {module_name!r} is not in this {node}'s {setting} ({listed}); only modules its operator "
        f"lists there (its config file or BATCHBUS_{setting.upper()}) may run, nothing was imported. "
        f"{typo}To allow {'it as it is' if meant else 'it'}, the operator lists {entry}"
    )


def closest_allowed(module_name: str, allowed: Collection[str]) -> str | None:
    """The module ``allowed`` permits that ``module_name`` most likely misspells: an exact entry, or
    ``module_name`` with its package part corrected to a package entry's (``mylba.train`` for
    ``mylab.``); None when nothing is close."""
    candidates = set()
    for entry in allowed:
        prefix = entry.removesuffix("*")
        if prefix.endswith("."):  # the package's components in place of as many of the name's, the rest as given
            parts, depth = module_name.split("."), prefix.count(".")
            if len(parts) > depth:
                candidates.add(prefix + ".".join(parts[depth:]))
        else:
            candidates.add(entry)
    candidates.discard(module_name)
    found = difflib.get_close_matches(module_name, sorted(candidates), n=1, cutoff=0.8)
    return found[0] if found else None


def import_allowed(ref: str, allowed: Collection[str], what: str, setting: str = "user_modules") -> object:
    """The attribute ``name`` of ``module`` for ``ref`` = ``"module:name"``, if ``module`` is in ``allowed``.

    ``what`` names the reference in messages (``"model 'pkg.mod:build'"``); ``setting`` the node's
    setting that lists ``allowed``.

    Raises:
        BadRequest: a malformed reference, a module the node does not allow (named with the setting
            to change; nothing is imported then), or one that cannot be imported or lacks ``name``.
    """
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr.isidentifier() or attr.startswith("_"):
        raise BadRequest(f"{what}: give package.module:name (a public name), got {ref!r}")
    if not module_allowed(module_name, allowed):
        raise BadRequest(not_allowed(what, module_name, allowed, setting))
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        meant = _closest_module(module_name) if isinstance(err, ModuleNotFoundError) else None
        hint = f"; did you mean {meant!r}? (fix the name where the job gives it and submit it again)" if meant else ""
        raise BadRequest(f"{what}: cannot import {module_name!r}: {err}{hint}") from err
    try:
        return getattr(module, attr)
    except AttributeError as err:
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None))]
        found = difflib.get_close_matches(attr, names, n=1, cutoff=0.6)
        hint = f"; did you mean {module_name}:{found[0]}?" if found else ""
        raise BadRequest(f"{what}: {module_name} has no {attr!r}{hint}") from err


def _closest_module(module_name: str) -> str | None:
    """The module ``module_name`` most likely misspells, among its nearest importable package's
    modules (``mylab.train`` for ``mylab.trian``); None when the package itself is not there or
    nothing is close. Lists the package's folder: imports nothing more."""
    package, _, leaf = module_name.rpartition(".")
    if not package:
        return None
    try:
        parent = importlib.import_module(package)
    except ImportError:
        return None
    paths = getattr(parent, "__path__", None)
    if paths is None:
        return None
    names = [info.name for info in pkgutil.iter_modules(paths)]
    found = difflib.get_close_matches(leaf, names, n=1, cutoff=0.6)
    return f"{package}.{found[0]}" if found else None
