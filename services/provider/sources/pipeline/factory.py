"""``pipeline://FILE.toml``: read a pipeline file and build its stages — the seed spec's ``CreateStage``.

The TOML file lists ``[[stages]]``: one ``source`` (any URI the provider opens) and transforms, each
naming its predecessor in ``input`` (docs/datasets.md §4)::

    seed = 0
    [[stages]]
    name = "images"
    source = { uri = "mock://cifar10?n=2000" }
    [[stages]]
    name = "norm"
    input = "images"
    normalize = { mean = [0.0, 0.0, 0.0], std = [2.0, 2.0, 2.0] }

:func:`build_pipeline` checks the graph (one type per stage, known inputs, no cycle, one source, one
chain) and each stage's parameters against what its input produces, and refuses a bad pipeline
with a :class:`ConfigError` (a :class:`DatasetError` for a source it cannot open) naming the file
and the stage. When the source serves named fields, each transform also names the field it acts on
(``field = "image"``) and is built against that field (:mod:`.fields`).
"""

from __future__ import annotations

import logging
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import cast

from libbus.errors import ConfigError, DatasetError

from ..base import OpenRequest, Source
from .engine import Pipeline
from .fields import FieldsPlan, FieldStage
from .image_stages import IMAGE_STAGES
from .stages import RandomStage, SourceStage, Spec, Stage, source_of
from .text_stages import TEXT_STAGES
from .transforms import STAGE_TYPES as BUILTIN_TYPES
from .user_stage import UserStage

__all__ = ["TOP_KEYS", "build_pipeline", "open_pipeline"]

log = logging.getLogger(__name__)

#: Stage types: the source, the array transforms, the image and the text stages, and ``user``
#: (operator-installed code, :mod:`.user_stage`).
STAGE_TYPES: dict[str, type[Stage]] = {**BUILTIN_TYPES, **IMAGE_STAGES, **TEXT_STAGES, "user": UserStage}

#: Top-level keys of a pipeline file, with their defaults.
TOP_KEYS = {"stages": None, "seed": 0, "chunk": 64, "queue_capacity": 4}


def _positive(where: str, key: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _stage_tables(where: str, stages) -> dict[str, dict]:
    """Name → stage table, checking names and that each stage has exactly one type."""
    if not isinstance(stages, list) or not stages or not all(isinstance(s, dict) for s in stages):
        raise ConfigError(f"{where}: expected a list of [[stages]] tables, got {type(stages).__name__}")
    known = ", ".join(STAGE_TYPES)
    tables: dict[str, dict] = {}
    for number, table in enumerate(stages, 1):
        name = table.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f'{where}: stage #{number} has no name (name = "…")')
        if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise ConfigError(f"{where}: stage name {name!r} may hold letters, digits, '-', '_', '.'")
        if name in tables:
            raise ConfigError(f"{where}: two stages are named {name!r}")
        types = [k for k in table if k in STAGE_TYPES]
        unknown = sorted(set(table) - set(STAGE_TYPES) - {"name", "input", "field"})
        if unknown:
            raise ConfigError(
                f"{where}: stage {name!r}: unknown key(s) {', '.join(unknown)}; a stage has "
                f"name, input, field (with a source of named fields) and one of {known}"
            )
        if len(types) != 1:
            what = "no type" if not types else f"{len(types)} types ({', '.join(types)})"
            raise ConfigError(f"{where}: stage {name!r} has {what}; give exactly one of {known}")
        if not isinstance(table[types[0]], dict):
            raise ConfigError(
                f"{where}: stage {name!r}: {types[0]} must be a table of parameters, "
                f"got {type(table[types[0]]).__name__}"
            )
        for key in ("input", "field"):
            if key in table and not isinstance(table[key], str):
                raise ConfigError(f"{where}: stage {name!r}: {key} must be a {key} name, got {table[key]!r}")
        tables[name] = table
    return tables


def _chain(where: str, tables: dict[str, dict]) -> list[str]:
    """The stage names from the source to the one sink; refuses anything that is not one chain."""
    names = list(tables)
    sources = [n for n in names if "source" in tables[n]]
    if not sources:
        raise ConfigError(f'{where}: no source stage; add one with source = {{ uri = "…" }}')
    if len(sources) > 1:
        raise ConfigError(f"{where}: {len(sources)} source stages ({', '.join(sources)}); a pipeline has exactly one")
    for name, table in tables.items():
        is_source = "source" in table
        if is_source and "input" in table:
            raise ConfigError(f"{where}: stage {name!r} is a source and takes no input")
        if not is_source and "input" not in table:
            raise ConfigError(f"{where}: stage {name!r} needs an input (the name of the stage it reads)")
        if not is_source and table["input"] not in tables:
            raise ConfigError(
                f"{where}: stage {name!r} reads input {table['input']!r}, which is not a stage; "
                f"stages: {', '.join(names)}"
            )
    for name in names:  # every stage has one input: walking back either reaches a source or loops
        seen = [name]
        while "input" in tables[seen[-1]]:
            nxt = tables[seen[-1]]["input"]
            if nxt in seen:
                loop = seen[seen.index(nxt) :] + [nxt]
                raise ConfigError(
                    f"{where}: stages form a cycle: {' -> '.join(reversed(loop))} "
                    f"(stage {name!r} never reaches a source)"
                )
            seen.append(nxt)
    readers: dict[str, list[str]] = {n: [] for n in names}
    for name in names:
        if "input" in tables[name]:
            readers[tables[name]["input"]].append(name)
    sinks = [n for n in names if not readers[n]]
    if len(sinks) > 1:
        forks = [f"{n!r} feeds {', '.join(repr(r) for r in rs)}" for n, rs in readers.items() if len(rs) > 1]
        raise ConfigError(
            f"{where}: {len(sinks)} sinks ({', '.join(sinks)}): stage {'; '.join(forks)}; "
            "a pipeline is one chain, each stage read by at most one other"
        )
    chain = [sources[0]]
    while readers[chain[-1]]:
        chain.append(readers[chain[-1]][0])
    return chain


def build_pipeline(
    config: dict,
    uri: str,
    where: str | None = None,
    *,
    open_source: Callable[[str], Source],
    user_modules: frozenset[str] = frozenset(),
) -> Pipeline:
    """Build and check a pipeline from its parsed TOML ``config``.

    Raises :class:`ConfigError` (or :class:`DatasetError` for a source that cannot be opened) naming
    ``where`` (the file) and the stage at fault. ``open_source`` opens the source stage's URI;
    ``user`` stages may run only functions of ``user_modules`` (the provider's own settings).
    """
    where = where or uri
    unknown = sorted(set(config) - set(TOP_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; a pipeline file has {', '.join(TOP_KEYS)}")
    settings = {**TOP_KEYS, **config}
    if settings["stages"] is None:
        raise ConfigError(f"{where}: no [[stages]]; a pipeline is a list of them, a source first")
    seed = settings["seed"]
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"{where}: seed must be a non-negative integer, got {seed!r}")
    chunk = _positive(where, "chunk", settings["chunk"])
    capacity = _positive(where, "queue_capacity", settings["queue_capacity"])
    tables = _stage_tables(where, settings["stages"])
    chain = _chain(where, tables)
    stages: list[Stage] = []
    spec: Spec | None = None
    plan: FieldsPlan | None = None
    try:
        for name in chain:
            table = tables[name]
            kind = next(k for k in table if k in STAGE_TYPES)
            if plan is None or kind == "source":
                _no_field(table, name, kind, stages)
                stage = _stage(STAGE_TYPES[kind], name, table[kind], spec, seed, open_source, user_modules)
                if isinstance(stage, SourceStage) and not stage.source.xy:
                    plan = FieldsPlan(where, stage.source.fields, stage.source.num_classes)
            else:  # a source of named fields: the stage acts on the one it names
                stage = _field_stage(plan, table, name, kind, seed, open_source, user_modules)
            stages.append(stage)
            spec = stage.spec
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from err
    except DatasetError as err:
        raise DatasetError(f"{where}: {err}") from err
    if plan is not None:
        plan.output()  # refuses a field left encoded
        log.debug("%s: named fields %s", where, ", ".join(f"{s.name} ({s.type})" for s in stages))
        return Pipeline(uri, stages, chunk=chunk, queue_capacity=capacity, plan=plan)
    if spec is not None and spec.kind in ("encoded", "decoded", "token_lists"):
        what = (
            "token ids of any length; end with pack"
            if spec.kind == "token_lists"
            else (
                f"{spec.kind} images of any size; end with center_crop or random_resized_crop (fixed (3, H, W) samples)"
            )
        )
        raise ConfigError(f"{where}: the last stage {chain[-1]!r} leaves {what}")
    log.debug("%s: %s", where, " -> ".join(f"{s.name} ({s.type})" for s in stages))
    return Pipeline(uri, stages, chunk=chunk, queue_capacity=capacity)


def _stage(cls: type[Stage], name: str, config: dict, spec: Spec | None, seed: int, open_source, user_modules) -> Stage:
    if issubclass(cls, SourceStage):
        return cls(name, config, None, open_source=open_source)  # the chain's first stage: no input
    if spec is None:  # unreachable: _chain starts every pipeline at its one source
        raise ConfigError(f"stage {name!r} ({cls.type}) needs an input")
    if cls is UserStage:
        return UserStage(name, config, spec, seed, allowed=user_modules)
    if issubclass(cls, RandomStage):
        return cls(name, config, spec, seed)
    return cls(name, config, spec)


def _no_field(table: dict, name: str, kind: str, stages: list[Stage]) -> None:
    """Refuse ``field =`` on a source stage or in a pipeline whose source serves x/y."""
    if "field" not in table:
        return
    if kind == "source":
        raise ConfigError(f"stage {name!r} (source): a source takes no field; the stages after it name theirs")
    raise ConfigError(
        f"stage {name!r} ({kind}): field = names one of a source's named fields, and "
        f"{source_of(stages).uri} serves x/y samples; leave field out"
    )


def _field_stage(plan: FieldsPlan, table: dict, name: str, kind: str, seed: int, open_source, user_modules) -> Stage:
    """Stage ``name`` acting on the named field its table's ``field`` gives (:mod:`.fields`)."""
    if "field" not in table:
        raise ConfigError(
            f"stage {name!r} ({kind}): the source serves named fields ({', '.join(plan.source)}); "
            f'name the one this stage acts on, e.g. field = "{next(iter(plan.source))}"'
        )
    field = table["field"]
    spec, convert = plan.input_spec(name, kind, field)
    if kind == "decode" and plan.source[field].dtype != "bytes" and field not in plan.specs:
        raise ConfigError(f"stage {name!r} (decode): field {plan.source[field].describe()} is not encoded bytes")
    if kind == "tokenize" and plan.source[field].dtype != "str" and field not in plan.specs:
        raise ConfigError(f"stage {name!r} (tokenize): field {plan.source[field].describe()} is not text")
    stage = _stage(STAGE_TYPES[kind], name, table[kind], spec, seed, open_source, user_modules)
    if stage.spec.label_shape != spec.label_shape or stage.spec.label_dtype != spec.label_dtype:
        if kind != "tokenize":  # tokenize drops x/y labels, which a field never had
            raise ConfigError(f"stage {name!r} ({kind}): acts on x/y labels; a named field has none")
    plan.specs[field] = stage.spec
    # it answers as the stage it wraps does (name, type, spec, counters, control): one to the engine
    return cast(Stage, FieldStage(stage, field, convert, plan.where))


def open_pipeline(req: OpenRequest) -> Pipeline:
    """``pipeline:///abs/file.toml`` or ``pipeline://rel/file.toml`` (relative to the working directory)."""
    uri, parts = req.uri, req.parts
    path = Path(parts.netloc + parts.path) if parts.netloc else Path(parts.path)
    if not str(path) or str(path) == ".":
        raise DatasetError(f"{uri}: name the pipeline file, e.g. pipeline:///etc/batchbus/cifar.toml")
    try:
        config = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise DatasetError(f"{uri}: pipeline file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DatasetError(f"{uri}: cannot read pipeline file {path}: {err}") from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{uri}: {path} is not valid TOML: {err}") from err
    return build_pipeline(config, uri, str(path), open_source=req.open, user_modules=req.user_modules)
