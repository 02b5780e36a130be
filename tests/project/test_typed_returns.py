"""A function whose result another module reads returns a type that names its keys: a ``TypedDict`` for a
JSON, wire or SQLite record, a dataclass, or a map whose values are typed (``dict[str, np.ndarray]``),
never a bare ``dict``, ``dict[str, Any]`` or ``dict[str, object]`` that each reader parses again.

Checked from the source (no import runs): every function of the product (``libbus``, ``services``, ``cli``,
``shm``) annotated to return one of those, whose name another product module uses, must be in
:data:`ALLOWED` with its reason (``not yet typed: …`` names what is left to type); an entry that no
longer names such a function fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from tests.support import REPO

ROOTS = ("libbus", "services", "cli", "shm")

#: Return annotations that say nothing of the keys (``| None`` beside them says nothing more): a bare dict,
#: or a list of them (rows).
_DICT = r"(dict|Dict|dict\[str, (Any|object)\]|Dict\[str, (Any|object)\])"
BARE = re.compile(rf"^({_DICT}|(builtins\.)?(list|List)\[{_DICT}\])( \| None)?$")

#: ``path::Qualified.name`` → why it returns a bare dict. Serialization boundaries return dicts by contract.
ALLOWED: dict[str, str] = {
    "libbus/config.py::Settings.as_dict": "serialization: the settings as `busctl config show --json` prints them and an attempt is handed them",
    "libbus/config.py::Settings.redacted": "serialization: as_dict with credentials masked, for printing",
    "libbus/jobapi/job.py::Job.restore": "the job function's own state as it checkpointed it: its keys are the user's",
    "libbus/jobs/spec.py::JobSpec.settable": "a job's own keys: an entrypoint's params (or a built-in job's SETTABLE hyper-parameters), what busctl job set may change",
    "libbus/jobs/spec.py::JobSpec.to_dict": "serialization: a spec's JSON, the inverse of from_dict",
    "libbus/jobs/spec.py::SpikeSpec.to_dict": "serialization: a spec's JSON, the inverse of from_dict",
    "libbus/loader/remote.py::RemoteLoader.state_dict": "PyTorch's state_dict contract: what load_state_dict and torch.distributed.checkpoint load",
    "libbus/order/elastic.py::merge": "a state_dict (PyTorch's contract) for load_state_dict, merged from the ranks'",
    "libbus/order/elastic.py::merge_cursors": "a state_dict (PyTorch's contract) for load_state_dict, merged from the ranks'",
    "libbus/order/elastic.py::state": "the loader's state_dict contents (PyTorch's contract), with its elastic plan",
    "libbus/order/epochs.py::Order.state": "the loader's state_dict contents (PyTorch's contract): the cursor and its settings",
    "libbus/wire/frames.py::Message.header": "serialization: a frame's JSON header, checked against the message's annotations",
    "services/provider/sources/formats/dataset_toml.py::parse_dataset_toml": "dataset.toml as its author wrote it, its keys checked: parse_settings (DatasetSettings) and the raw layout check the values they read",
    "services/provider/sources/formats/location.py::Location.toml": "dataset.toml as its author wrote it, its keys checked: parse_settings (DatasetSettings) and the raw layout check the values they read",
    "services/provider/sources/formats/mds.py::read_index": "an MDS index.json as a dataset's files hold it (a peer's JSON, unchecked): each value is checked where it is read",
    "services/provider/sources/pipeline/engine.py::stage_control": "Ok.detail of StageControl: the stage's answer (its keys are the stage's) under dataset, stage and type",
    "services/provider/sources/pipeline/stages.py::RandomStage.control": "a stage's answer to a control command (Ok.detail, printed by busctl control): a user's stage answers its own commands with its own keys",
    "services/provider/sources/pipeline/stages.py::Stage.control": "a stage's answer to a control command (Ok.detail, printed by busctl control): a user's stage answers its own commands with its own keys",
    "services/router/job_results.py::JobResults.keep_model": "a job's result as its trainer reported it (JSON, the router's test_* and model keys added): its keys include the job's own metrics",
    "services/router/job_results.py::JobResults.scored": "a job's result as its trainer reported it (JSON, the router's test_* and model keys added): its keys include the job's own metrics",
    "services/router/pbt.py::explore": "a job's params with its hyper-parameters perturbed: the spec's keys and an entrypoint's own (params.NAME)",
    "services/router/scores.py::TestScores.result": "a job's result as its trainer reported it (JSON, the router's test_* and model keys added): its keys include the job's own metrics",
    "services/router/store.py::JobStore.progress_history": "a job's progress reports as its trainer sent them, each with its time: their keys include the job's own metrics",
    "services/router/study_spec.py::StudySpec.to_dict": "serialization: a study spec's JSON, the inverse of from_dict",
    "services/trainer/attempt/jobapi.py::AttemptJob._read": "the job function's own state as it checkpointed it: its keys are the user's",
    "services/trainer/attempt/jobapi.py::AttemptJob.restore": "the job function's own state as it checkpointed it: its keys are the user's",
    "services/trainer/attempt_user.py::AttemptUser.as_dict": "serialization: handed to the attempt's process, the inverse of from_dict",
    "services/trainer/service/attempt_settings.py::attempt_settings": "serialization: Settings.as_dict as the attempt's process is handed it, credentials withheld",
    "services/trainer/service/attempt_settings.py::ungranted_settings": "serialization: Settings.as_dict as the attempt's process is handed it, with its trainer's token",
    "services/web/logins.py::Login.summary": "what an unverified token claims, shown as JSON on the page: its values are whatever the token holds",
    "shm/gc.py::SegmentInfo.as_dict": "serialization: a segment's row as `busctl shm --json` prints it",
}


def bare_dict_returns(root: Path, roots: tuple[str, ...] = ROOTS) -> list[str]:
    """``path::qualname`` of each function under ``roots`` whose return annotation is in :data:`BARE` and
    whose name another module under ``roots`` uses (as a whole word), sorted."""
    sources = {p: p.read_text() for r in roots for p in sorted((root / r).rglob("*.py"))}
    found = []
    for path, text in sources.items():
        for qualname, name in _bare_functions(ast.parse(text)):
            if name.startswith("__"):
                continue
            word = re.compile(rf"\b{re.escape(name)}\b")
            if any(word.search(other) for p, other in sources.items() if p != path):
                found.append(f"{path.relative_to(root).as_posix()}::{qualname}")
    return sorted(set(found))


def _bare_functions(tree: ast.Module) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = prefix + child.name
                if child.returns is not None and BARE.match(ast.unparse(child.returns)):
                    out.append((qualname, child.name))
                # a function defined inside another is not reachable from another module
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")
            else:
                walk(child, prefix)

    walk(tree, "")
    return out


@cache
def _product() -> tuple[str, ...]:
    return tuple(bare_dict_returns(REPO))


def test_no_bare_dict_crosses_a_module_unless_allowed():
    unexplained = [f for f in _product() if f not in ALLOWED]
    assert not unexplained, (
        "these functions return a bare dict that another module reads; return a TypedDict (a JSON, wire or "
        "SQLite record), a dataclass, or a map with typed values, or add them to ALLOWED with the reason:\n  "
        + "\n  ".join(unexplained)
    )


def test_every_allowed_entry_still_names_such_a_function():
    """The list only shrinks: a function typed since (or gone) leaves it, so it never excuses a new one."""
    stale = sorted(set(ALLOWED) - set(_product()))
    assert not stale, f"these no longer return a bare dict read elsewhere; remove them from ALLOWED: {stale}"


def test_every_allowed_entry_says_why():
    assert all(reason.strip() for reason in ALLOWED.values())


def test_a_bare_dict_read_by_another_module_is_found(tmp_path):
    """What a careless change does: a helper returning ``-> dict`` (or ``dict[str, Any]``) that another
    module calls. The check names it; one used only in its own module, or typed, is left alone."""
    pkg = tmp_path / "libbus"
    pkg.mkdir()
    (pkg / "rows.py").write_text(
        "from typing import Any, TypedDict\n\n"
        "class Row(TypedDict):\n    n: int\n\n"
        "def f() -> dict:\n    return {}\n\n"
        "class Store:\n    def get(self) -> dict[str, Any] | None:\n        return None\n\n"
        "def typed() -> Row:\n    return {'n': 1}\n\n"
        "def own() -> dict:\n    return {}\n\n"
        "def arrays() -> dict[str, list[int]]:\n    return {}\n\n"
        "def rows() -> list[dict]:\n    return []\n"
    )
    (pkg / "user.py").write_text(
        "from libbus.rows import Store, arrays, f, rows, typed\n\nprint(f(), Store().get(), typed(), arrays(), rows())\n"
    )
    assert bare_dict_returns(tmp_path, ("libbus",)) == [
        "libbus/rows.py::Store.get",
        "libbus/rows.py::f",
        "libbus/rows.py::rows",
    ]
