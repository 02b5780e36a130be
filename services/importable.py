"""What a trainer can import for jobs, told to the router so that a job naming a module no trainer
can import is refused at submit ("did you mean"), not at the trainer after it queued.

A trainer says, in its ``Hello`` (``caps.job_modules``, :func:`announce`): its ``job_modules``
allow-list, the module names under it that it can import, whether that list is complete, and its
built-in models. The names are found without importing anything: each allowed package's folders are
listed (``pkgutil.iter_modules`` over the spec's search locations, found by the import system's
finders with the parent's locations as the path), never its ``__init__`` run; at most
:data:`MAX_NAMES` names (then the list says it is incomplete).

The router reads that (:class:`TrainerModules`, every field bounded; a malformed or oversized
announcement refuses the trainer's Hello) and checks a job's ``entrypoint`` and ``model =
"module:factory"`` module at submit (:meth:`TrainerModules.check`): refused when trainers are
connected (those whose token may take the job's dataset) and none of them can import it, naming the
closest module they can and what each allows.
A function's name is not checked there (that needs an import); the trainer's own check at run time
still answers a typo in it with "did you mean". With no trainer connected, or one that said nothing
(an older trainer), or an incomplete list that might hold the module, the job is accepted and the
reply says what could not be checked.
"""

from __future__ import annotations

import difflib
import pkgutil
import re
import sys
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import NoReturn, TypedDict

from libbus.errors import BadRequest
from libbus.jobs.spec import BUILTIN_MODELS, JobSpec, dataset_name

from .usercode import module_allowed

__all__ = ["MAX_NAMES", "JobModules", "TrainerModules", "announce", "importable_modules"]

#: The most module names a trainer announces, and the router accepts (it refuses a Hello with more).
MAX_NAMES = 2000
#: The most bytes of module names a trainer announces (its whole Hello's caps are bounded at 256 KiB).
MAX_NAMES_BYTES = 128 << 10
#: The most allow-list entries the router accepts from a trainer.
MAX_ALLOW = 256
#: The longest module name or allow-list entry, in characters.
MAX_NAME_CHARS = 200
#: How deep a package's subpackages are listed.
MAX_DEPTH = 8
#: How many trainers a refusal names (the rest are counted).
SHOWN_TRAINERS = 4

_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_ENTRY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(\.|\.\*)?")


def _find_spec(fullname: str, path: list[str] | None):
    """The module's spec from the import system's finders, ``path`` the parent's search locations
    (None: a top-level name): what ``importlib`` does, without importing the parent."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(fullname, path, None)
        except Exception:  # noqa: BLE001 - a broken finder or folder: not importable from here
            continue
        if spec is not None:
            return spec
    return None


def _spec_of(name: str):
    """The spec of the dotted module ``name``, each package found by the finders in its parent's
    locations: no package's ``__init__`` runs. None when some part is not there."""
    path: list[str] | None = None
    spec, parts = None, name.split(".")
    for i in range(len(parts)):
        spec = _find_spec(".".join(parts[: i + 1]), path)
        if spec is None:
            return None
        if i < len(parts) - 1:
            locations = spec.submodule_search_locations
            if not locations:
                return None
            path = list(locations)
    return spec


def importable_modules(allowed: Collection[str], limit: int = MAX_NAMES) -> tuple[list[str], bool]:
    """The modules ``allowed`` (a ``job_modules`` list) lets a job name that this process can
    import, found without importing any; and whether the list is complete (False: more than
    ``limit`` names or :data:`MAX_NAMES_BYTES`, or packages nested deeper than :data:`MAX_DEPTH`)."""
    names: list[str] = []
    seen: set[str] = set()
    complete = True
    size = 0

    def add(name: str) -> bool:
        nonlocal size
        if name in seen or len(name) > MAX_NAME_CHARS or not _MODULE.fullmatch(name):
            return True
        if len(names) >= limit or size + len(name) + 3 > MAX_NAMES_BYTES:  # as JSON: quotes and a comma
            return False
        seen.add(name)
        names.append(name)
        size += len(name) + 3
        return True

    exact = [e for e in allowed if not e.removesuffix("*").endswith(".")]
    for entry in exact:  # each exact entry is looked at, whatever the walks find later
        if _spec_of(entry) is not None and not add(entry):
            return names, False
    for entry in allowed:
        prefix = entry.removesuffix("*")
        if not prefix.endswith(".") or not _MODULE.fullmatch(prefix[:-1]):
            continue
        spec = _spec_of(prefix[:-1])
        if spec is None or not spec.submodule_search_locations:
            continue
        todo = [(prefix[:-1], list(spec.submodule_search_locations), 1)]
        while todo:
            package, locations, depth = todo.pop(0)
            for info in sorted(pkgutil.iter_modules(locations, package + "."), key=lambda i: i.name):
                if not add(info.name):
                    return names, False
                if info.ispkg:
                    if depth >= MAX_DEPTH:
                        complete = False
                        continue
                    sub = _find_spec(info.name, locations)
                    if sub is not None and sub.submodule_search_locations:
                        todo.append((info.name, list(sub.submodule_search_locations), depth + 1))
    return names, complete


class JobModules(TypedDict):
    """A trainer Hello's ``caps.job_modules`` (docs/protocol.md, Hello)."""

    allow: list[str]
    modules: list[str]
    complete: bool
    builtin: list[str]


def announce(allowed: Collection[str]) -> JobModules:
    """A trainer's ``caps.job_modules``: what it allows, what of that it can import, whether that
    list is whole, and its built-in models."""
    names, complete = importable_modules(allowed)
    return {"allow": list(allowed), "modules": names, "complete": complete, "builtin": list(BUILTIN_MODELS)}


@dataclass(frozen=True)
class Announced:
    """One trainer's checked announcement."""

    name: str
    allow: tuple[str, ...]
    modules: frozenset[str]
    complete: bool

    def can_import(self, module: str) -> bool | None:
        """True, False, or None (its list is incomplete and might hold ``module``)."""
        if not module_allowed(module, self.allow):
            return False
        if module in self.modules or module in self.allow:
            return module in self.modules
        return False if self.complete else None


def _strings(value, what: str, most: int, pattern: re.Pattern) -> list[str]:
    if not isinstance(value, list):
        raise BadRequest(f"a trainer's caps.job_modules.{what} must be a list of names, got {type(value).__name__}")
    if len(value) > most:
        raise BadRequest(f"a trainer's caps.job_modules.{what} holds {len(value)} names; at most {most} are accepted")
    for item in value:
        if not isinstance(item, str) or len(item) > MAX_NAME_CHARS or not pattern.fullmatch(item):
            shown = repr(item)[:80] if isinstance(item, str) else type(item).__name__
            raise BadRequest(
                f"a trainer's caps.job_modules.{what} must hold module names of at most {MAX_NAME_CHARS} "
                f"characters, got {shown}"
            )
    return value


def parse(caps: dict, name: str) -> Announced | None:
    """A trainer Hello's ``caps.job_modules``, checked (None: it sent none, as an older trainer does).

    Raises:
        BadRequest: a malformed or oversized announcement.
    """
    raw = caps.get("job_modules")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadRequest(f"a trainer's caps.job_modules must be a table, got {type(raw).__name__}")
    allow = _strings(raw.get("allow", []), "allow", MAX_ALLOW, _ENTRY)
    modules = _strings(raw.get("modules", []), "modules", MAX_NAMES, _MODULE)
    complete = raw.get("complete", False)
    if not isinstance(complete, bool):
        raise BadRequest("a trainer's caps.job_modules.complete must be true or false")
    _strings(raw.get("builtin", []), "builtin", 64, re.compile(r"[A-Za-z0-9_.-]+"))
    return Announced(name[:MAX_NAME_CHARS], tuple(allow), frozenset(modules), complete)


def refs(spec: JobSpec) -> list[tuple[str, str]]:
    """``(field, reference)`` for each of the job's references to a module a trainer imports."""
    out = [("entrypoint", spec.entrypoint)] if spec.entrypoint else []
    if ":" in spec.model:
        out.append(("model", spec.model))
    return out


class TrainerModules:
    """The router's view of what its connected trainers can import, by session id."""

    def __init__(self) -> None:
        self._by_sid: dict[str, tuple[Announced | None, Callable[[str], bool]]] = {}

    def register(self, sid: str, name: str, caps: dict, takes: Callable[[str], bool] = lambda dataset: True) -> None:
        """Record a trainer session's announcement (raises BadRequest for a malformed one); ``takes``
        says whether its token lets it take a job of a dataset (a trainer that may not is not asked)."""
        self._by_sid[sid] = (parse(caps, name), takes)

    def drop(self, sid: str) -> None:
        self._by_sid.pop(sid, None)

    def check(self, spec: JobSpec) -> str:
        """Check every module the job names (a study's trials' too: its ``[base]``); returns what
        could not be checked ("" when all was).

        Raises:
            BadRequest: connected trainers, none of which can import a module the job names.
        """
        notes = [self.check_ref(field, ref, dataset_name(spec.dataset)) for field, ref in refs(spec)]
        return "; ".join(n for n in notes if n)

    def check_ref(self, field: str, ref: str, dataset: str = "") -> str:
        module = ref.partition(":")[0]
        trainers = [t for t, takes in self._by_sid.values() if not dataset or takes(dataset)]
        if not trainers:
            which = f"that may take dataset {dataset!r} " if self._by_sid else ""
            return (
                f"{field} module {module!r} not checked: no trainer {which}is connected (the job waits in "
                "the queue; a trainer that cannot import it fails it then)"
            )
        verdicts = [None if t is None else t.can_import(module) for t in trainers]
        if any(v is True for v in verdicts):
            return ""
        if any(v is None for v in verdicts):
            return f"{field} module {module!r} not checked: a connected trainer did not list all it can import"
        known = [t for t in trainers if t is not None]
        meant = _closest(module, known)
        hint = f"; did you mean {meant!r}? (fix the name and submit again)" if meant else ""
        return self._refuse(f"{field} {ref!r}: no connected trainer can import module {module!r}{hint}", module, known)

    @staticmethod
    def _refuse(head: str, module: str, trainers: list[Announced]) -> NoReturn:
        by_allow: dict[tuple[str, ...], list[str]] = {}
        for t in trainers:
            by_allow.setdefault(t.allow, []).append(t.name)
        parts = []
        for allow, names in list(by_allow.items())[:SHOWN_TRAINERS]:
            shown = ", ".join(sorted(set(names))[:SHOWN_TRAINERS]) + (
                f" and {len(set(names)) - SHOWN_TRAINERS} more" if len(set(names)) > SHOWN_TRAINERS else ""
            )
            listed = ", ".join(allow[:8]) + (", ..." if len(allow) > 8 else "") if allow else "nothing"
            why = "not found there" if module_allowed(module, allow) else "not allowed"
            parts.append(f"{shown} allow {listed} ({why})")
        if len(by_allow) > SHOWN_TRAINERS:
            parts.append(f"{len(by_allow) - SHOWN_TRAINERS} more allow-lists")
        raise BadRequest(
            f"{head}. Trainers: {'; '.join(parts)}. Their operators list what jobs may import in "
            "job_modules (BATCHBUS_JOB_MODULES); a trainer lists its importable modules as it connects "
            "(restart it after adding one)"
        )


def _closest(module: str, trainers: Iterable[Announced]) -> str | None:
    """The importable module ``module`` most likely misspells, among what the trainers listed."""
    candidates: set[str] = set()
    for t in trainers:
        candidates |= t.modules
    candidates.discard(module)
    found = difflib.get_close_matches(module, sorted(candidates), n=1, cutoff=0.8)
    return found[0] if found else None
