"""The house's layers, checked from the source (no import runs): the import graph of the project's modules
has no cycle, no package imports a higher layer, no module imports another's private name, test files
import helpers only from ``tests.support``, and a job or study spec is parsed only where it enters a process.

Every ``import`` counts, the ones inside functions too: an import moved into a function to dodge a cycle
is still the cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

from tests.support import REPO

#: Lower layers first; a module may import its own layer and the ones below, never one above.
LAYERS = ["shm", "libbus", "services", "benchmarks", "cli"]
#: Inside libbus, lower floors first. A folder imports its own modules and the floors below; folders on one
#: floor are neighbours that never import each other (the loader and the server framework know nothing of
#: one another). The package's face (``libbus/__init__.py``) stands above them all and nothing inside imports it.
LIBBUS_FLOORS = [
    {"errors", "constants"},
    {"wire"},
    {"security"},
    {"serve", "connect", "order"},
    {"jobs", "config"},
    {"loader", "jobapi"},
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _modules() -> dict[str, Path]:
    files = [p for top in [*LAYERS, "tests"] for p in (REPO / top).rglob("*.py")]
    return {_module_name(p): p for p in files}


def _is_package(name: str) -> bool:
    return _modules()[name].name == "__init__.py"


def _import_statements(body: list[ast.stmt]):
    """Every import statement, at any depth (functions, classes, ifs, trys), without walking expressions."""
    stack = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
            continue
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            stack.extend(getattr(node, field, ()))


@cache
def _imports(name: str) -> list[tuple[str, list[str], int]]:
    """(imported project module, names taken from it, line) for every import statement in ``name``."""
    modules = _modules()
    tree = ast.parse(modules[name].read_text(), str(modules[name]))
    package = name if _is_package(name) else name.rpartition(".")[0]
    out = []
    for node in _import_statements(tree.body):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [a.name for a in node.names]
            subs = [n for n in names if f"{base}.{n}" in modules]
            out += [(f"{base}.{n}", [], node.lineno) for n in subs]
            rest = [n for n in names if n not in subs]
            if rest or not subs:
                out.append((base, rest, node.lineno))
    return [(target, names, line) for target, names, line in out if target in modules]


def _edges() -> dict[str, set[str]]:
    return {name: {target for target, _, _ in _imports(name)} for name in _modules()}


def _layer(name: str) -> int | None:
    top = name.partition(".")[0]
    return LAYERS.index(top) if top in LAYERS else None


def test_the_project_has_no_import_cycle():
    graph = _edges()
    # Tarjan's strongly connected components, iteratively (no recursion limit to meet)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph[node]:
                        cycles.append(sorted(component))
    assert not cycles, "import cycles (each list imports itself round): " + "; ".join(map(str, cycles))


def test_no_package_imports_a_higher_layer():
    wrong = []
    for name in _modules():
        mine = _layer(name)
        if mine is None:
            continue
        for target, _, line in _imports(name):
            theirs = _layer(target)
            if theirs is None or theirs > mine:
                wrong.append(f"{_modules()[name].relative_to(REPO)}:{line} imports {target}")
    assert not wrong, f"layers are {' < '.join(LAYERS)}; these import upwards:\n" + "\n".join(wrong)


def _libbus_floor(name: str) -> tuple[int, str] | None:
    """(floor, room) of a libbus module: ``libbus.wire.frames`` is on floor 1, room ``wire``."""
    parts = name.split(".")
    if parts[0] != "libbus" or len(parts) < 2:
        return None
    for floor, rooms in enumerate(LIBBUS_FLOORS):
        if parts[1] in rooms:
            return floor, parts[1]
    return None


def test_every_libbus_module_has_a_floor():
    homeless = [n for n in _modules() if n.startswith("libbus.") and _libbus_floor(n) is None]
    assert not homeless, f"libbus modules outside LIBBUS_FLOORS (add their folder to a floor): {homeless}"


def test_libbus_folders_import_only_their_own_and_lower_floors():
    wrong = []
    for name in _modules():
        mine = _libbus_floor(name)
        if mine is None:
            continue
        for target, _, line in _imports(name):
            if target == "libbus":
                wrong.append(f"{_modules()[name].relative_to(REPO)}:{line} imports the package's face")
                continue
            theirs = _libbus_floor(target)
            if theirs is None or theirs[1] == mine[1]:
                continue
            if theirs[0] >= mine[0]:
                wrong.append(f"{_modules()[name].relative_to(REPO)}:{line} imports {target}")
    floors = " < ".join("/".join(sorted(rooms)) for rooms in LIBBUS_FLOORS)
    assert not wrong, f"libbus floors are {floors}; these import sideways or upwards:\n" + "\n".join(wrong)


def test_the_router_never_imports_the_loader():
    """The router is the control plane: nothing it imports, however indirectly, is the script API (torch)."""
    reach, todo = set(), [n for n in _modules() if n.startswith("services.router")]
    while todo:
        for target in _edges()[todo.pop()]:
            if target not in reach:
                reach.add(target)
                todo.append(target)
    assert not sorted(n for n in reach if n.startswith("libbus.loader"))


STORAGE = "services.provider.sources.storage"
FORMATS = "services.provider.sources.formats"


def test_storage_reads_bytes_for_any_layout_and_imports_none():
    """``sources/storage/`` (where bytes live: files, HTTP ranges, object stores, caches, confinement) is
    below ``sources/formats/`` (how they are laid out): a layout reads through storage, and nothing in
    storage imports a layout or a scheme's source (it would tie a backend to one format)."""
    modules = _modules()
    storage = [n for n in modules if n == STORAGE or n.startswith(STORAGE + ".")]
    assert f"{STORAGE}.objects" in storage and f"{STORAGE}.httprange" in storage
    above = {
        (name, target)
        for name in storage
        for target in _edges()[name]
        if target.startswith("services.provider") and not (target == STORAGE or target.startswith(STORAGE + "."))
    }
    assert not above, f"storage modules importing layouts or sources: {sorted(above)}"
    # every layout lives in formats/ (Parquet included), and formats/ holds no storage module
    assert f"{FORMATS}.parquet" in modules and "services.provider.sources.parquet" not in modules
    misplaced = [n for n in modules if n.startswith(FORMATS + ".") and n.rpartition(".")[2] in _STORAGE_NAMES]
    assert not misplaced, misplaced


_STORAGE_NAMES = {"objects", "httprange", "blockcache", "blockmemory", "cache", "confine", "inflight", "reader"}


DECODE_CACHE = "services.provider.sources.pipeline.decode_cache"
#: The decode cache's parts, lowest first: keys and entries, the disk tier, the store, a pipeline's bindings.
DECODE_CACHE_PARTS = ["entries", "disk_tier", "store", "pipeline_bindings"]


def test_the_decode_cache_imports_only_its_lower_parts_and_no_pipeline():
    """Each part of ``pipeline/decode_cache/`` imports only the parts before it, nothing imports the package's
    face from inside, and no part imports the pipeline or the provider: the engine uses the cache, never the
    reverse, so a cache tier can be tested and changed without a pipeline."""
    modules = _modules()
    found = {n.rpartition(".")[2] for n in modules if n.startswith(DECODE_CACHE + ".")}
    assert found == set(DECODE_CACHE_PARTS), f"a decode cache module without its place in DECODE_CACHE_PARTS: {found}"
    wrong = []
    for rank, part in enumerate(DECODE_CACHE_PARTS):
        allowed = {f"{DECODE_CACHE}.{p}" for p in DECODE_CACHE_PARTS[:rank]}
        for target, _, line in _imports(f"{DECODE_CACHE}.{part}"):
            if target.startswith("services.") and target not in allowed:
                wrong.append(f"{part}.py:{line} imports {target}")
    assert not wrong, "the decode cache reaches above its floor:\n" + "\n".join(wrong)


TRAINER = "services.trainer"
SERVICE, ATTEMPT = f"{TRAINER}.service", f"{TRAINER}.attempt"
#: The one module of the attempt's folder the service names: the child's target, importing the rest only in the child.
ATTEMPT_ENTRY = f"{ATTEMPT}.entry"


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_trainers_two_processes_are_two_folders():
    """``trainer/service/`` (the trainer service: its router link and credentials) and ``trainer/attempt/``
    (the child process that runs the job's code) meet only at ``attempt/entry.py``: nothing the attempt
    imports, however indirectly, is the service's, and what both use (``trainer/*.py``) imports neither."""
    modules = _modules()
    trainer = [n for n in modules if _under(n, TRAINER)]
    assert f"{SERVICE}.app" in modules and f"{ATTEMPT}.child" in modules and ATTEMPT_ENTRY in modules
    shared = [n for n in trainer if n != TRAINER and not (_under(n, SERVICE) or _under(n, ATTEMPT))]
    wrong = []
    for name in trainer:
        for target, _, line in _imports(name):
            where = f"{modules[name].relative_to(REPO)}:{line} imports {target}"
            if _under(name, ATTEMPT) and _under(target, SERVICE):
                wrong.append(where)
            elif _under(name, SERVICE) and _under(target, ATTEMPT) and target not in (ATTEMPT, ATTEMPT_ENTRY):
                wrong.append(where)
            elif name in shared and (_under(target, SERVICE) or _under(target, ATTEMPT)):
                wrong.append(where)
    assert not wrong, "the trainer's process boundary is crossed:\n" + "\n".join(wrong)
    reach, todo = set(), [n for n in trainer if _under(n, ATTEMPT)]
    while todo:
        for target in _edges()[todo.pop()]:
            if target not in reach:
                reach.add(target)
                todo.append(target)
    assert not sorted(n for n in reach if _under(n, SERVICE)), "an attempt reaches the trainer service's modules"


def test_a_provider_starts_without_torch():
    """A provider imports torch only when it evaluates a model (lazily, services/provider/evaluator.py):
    a data node starts in a fraction of a second and without torch's few hundred MB (seen: 1.7 s and
    300 MB when the batch path's check of a built-in job's fields pulled in services.models)."""
    probe = "import sys, services.provider.app, services.process, services.credentials; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", "the provider's start-up imports torch"


def test_no_module_imports_another_modules_private_name():
    wrong = []
    for name in _modules():
        for target, names, line in _imports(name):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and target != name:
                wrong.append(f"{_modules()[name].relative_to(REPO)}:{line} takes {', '.join(private)} from {target}")
    assert not wrong, "private names used across modules (make them public or move them):\n" + "\n".join(wrong)


def test_test_files_import_helpers_only_from_tests_support():
    wrong = []
    for name in _modules():
        if not name.startswith("tests.") or name.startswith("tests.support"):
            continue
        for target, _, line in _imports(name):
            if target.startswith("tests") and not target.startswith("tests.support"):
                wrong.append(f"{_modules()[name].relative_to(REPO)}:{line} imports {target}")
    assert not wrong, (
        "a test file imports another test file or conftest; shared helpers go in "
        "tests/support/, fixtures in conftest.py:\n" + "\n".join(wrong)
    )


def test_the_checks_see_the_import_forms_they_police(tmp_path):
    """The graph reader itself: relative, from-package and function-level imports all become edges."""
    assert "services.provider.sources.base" in _edges()["services.provider.sources.registry"]
    assert "services.provider.sources.files" in _edges()["services.provider.sources.registry"]
    assert "shm.errors" in _edges()["libbus.errors"]
    # cli/start.py imports the provider's service inside a function
    assert "services.provider.app" in _edges()["cli.start"]


#: The only places a job or study spec is parsed (``JobSpec.from_dict``, ``StudySpec.from_dict``): where it
#: enters a process, and where a parsed one, changed, is checked again whole. Everything past them takes a
#: ``JobSpec`` or ``StudySpec``, never a dict to parse again. ``(file, function): why``.
SPEC_ENTRY_POINTS = {
    ("cli/studies.py", "load_study"): "busctl study submit checks the file as the router will, before sending it",
    ("services/router/handler.py", "RouterHandler.on_SubmitJob"): "a job enters the router",
    ("services/router/judges.py", "Judges.on_SubmitStudy"): "a study enters the router",
    ("services/router/study_spec.py", "StudySpec.from_dict"): "a study's [base] is parsed with the study",
    ("services/router/store.py", "stored_spec"): "the router reads a job's spec from its SQLite store",
    ("services/router/studies.py", "stored_study"): "the router reads a study from its SQLite store",
    ("services/trainer/service/app.py", "TrainerService._run_task"): "a task from the router enters the trainer",
    ("services/trainer/attempt/child.py", "run"): "the task enters the attempt's process from its trainer",
    ("libbus/jobs/spec.py", "JobSpec.updated"): "a parsed spec with changes is checked again as a whole",
}
_SPEC_TYPES = {"JobSpec", "StudySpec"}


def _spec_parses(source: str, where: str) -> list[tuple[str, int]]:
    """``(function, line)`` of each ``JobSpec.from_dict(...)``/``StudySpec.from_dict(...)`` call in ``source``
    (``cls.from_dict`` inside those classes too), the function named by its dotted path from the module."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(child, [*scope, child.name])
                continue
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and child.func.attr == "from_dict":
                owner = child.func.value
                name = owner.id if isinstance(owner, ast.Name) else ""
                if name in _SPEC_TYPES or (name == "cls" and any(s in _SPEC_TYPES for s in scope)):
                    found.append((".".join(scope), child.lineno))
            visit(child, scope)

    visit(ast.parse(source, where), [])
    return found


def test_a_spec_is_parsed_only_where_it_enters_a_process():
    product = [p for top in ("shm", "libbus", "services", "cli") for p in (REPO / top).rglob("*.py")]
    seen, wrong = set(), []
    for path in product:
        rel = str(path.relative_to(REPO))
        for function, line in _spec_parses(path.read_text(), rel):
            seen.add((rel, function))
            if (rel, function) not in SPEC_ENTRY_POINTS:
                wrong.append(f"{rel}:{line} ({function or 'module level'})")
    assert not wrong, (
        "a job or study spec parsed again past where it entered its process: take the JobSpec/StudySpec "
        "parsed there (or add a true entry point to SPEC_ENTRY_POINTS, with its reason):\n" + "\n".join(wrong)
    )
    stale = sorted(f"{f}: {fn}" for f, fn in set(SPEC_ENTRY_POINTS) - seen)
    assert not stale, "SPEC_ENTRY_POINTS names places that parse no spec (moved or gone):\n" + "\n".join(stale)


def test_the_spec_check_sees_each_form_of_parse():
    source = (
        "def run(task):\n"
        "    return JobSpec.from_dict(task.spec)\n"
        "class Handler:\n"
        "    def on_get(self, job):\n"
        "        def inner():\n"
        "            return [StudySpec.from_dict(s) for s in job]\n"
        "        return inner\n"
        "class JobSpec:\n"
        "    @classmethod\n"
        "    def copy(cls, raw):\n"
        "        return cls.from_dict(raw)\n"
        "spec = JobSpec.from_dict({})\n"
        "other = Settings.from_dict({})\n"
    )
    assert _spec_parses(source, "example.py") == [
        ("run", 2),
        ("Handler.on_get.inner", 6),
        ("JobSpec.copy", 11),
        ("", 12),
    ]
