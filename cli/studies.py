"""``busctl study submit|show|watch|stop`` and ``busctl studies``: hyper-parameter studies the router runs
(services/router/studies.py), and the evaluation tasks and current models of ``busctl submit
--evaluate --model JOB|FILE`` and ``busctl job model --current``."""

from __future__ import annotations

import hashlib
import re
import time
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeGuard

import orjson
import typer

from libbus.config import Settings
from libbus.errors import BadRequest
from libbus.jobs.commands import JobCommand
from libbus.wire.messages import ControlJob, Model, StopStudy, SubmitStudy, frame_buffer
from services import views
from services.router.study_store import StudyState

if TYPE_CHECKING:
    from services.router.studies import ShownTrial, StudyView

from .connection import admin_client
from .options import Json, admin_options
from .output import echo, fail, guard, print_json

__all__ = [
    "study_app",
    "trial_value",
    "studies",
    "evaluation_task",
    "is_model_ref",
    "looks_like_model_ref",
    "current_model",
    "weights_line",
]

study_app = typer.Typer(
    no_args_is_help=True, help="Hyper-parameter studies the router runs (docs/operations.md §Studies)."
)

_JOB_ID = re.compile(r"^j[0-9a-f]{10}$")


def load_study(path: Path) -> dict:
    """A study file's tables, checked here as the router would check them (exit 2 when wrong)."""
    from services.router.study_spec import StudySpec  # noqa: PLC0415 - keeps busctl start-up light

    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        fail(f"study file {path} does not exist", 2)
    except tomllib.TOMLDecodeError as err:
        fail(f"study file {path} is not valid TOML: {err}", 2)
    try:
        StudySpec.from_dict(raw)
    except BadRequest as err:
        fail(f"study file {path}: {err}", 2)
    return raw


@study_app.command("submit")
@guard
@admin_options
def study_submit(
    file: Annotated[Path, typer.Argument(help="TOML study file: [base], [space], [study].")],
    *,
    settings: Settings,
    json: Json = False,
) -> None:
    """Start a study; prints its id."""
    raw = load_study(file)
    with admin_client(settings) as client:
        study = client.request(SubmitStudy(spec=raw)).study
    print_json({"study": study["id"]}) if json else echo(study["id"])


@study_app.command("show")
@guard
@admin_options
def study_show(study: str, *, settings: Settings, json: Json = False) -> None:
    """A study's trials (job, params, state, objective value, epochs trained) and its best trial."""
    with admin_client(settings) as client:
        info = views.study(client, study)
    if json:
        print_json(info)
        return
    _print_study(info)


def _print_study(info: StudyView) -> None:
    """The study's line, a row per trial, the note on values not final, and its best trial."""
    echo(
        f"study {info['id']}: {info['state']}{' (' + info['reason'] + ')' if info['reason'] else ''}; "
        f"objective {info['objective']} ({info['direction']}d); epochs trained {info['epochs_trained']:g} "
        + (
            f"of {info['epochs_budget']} if every trial ran to the end"
            if info["epochs_budget"] is not None
            else "(its trials' params name no epochs: no budget to show)"
        )
    )
    echo(f"{'#':>3}  {'job':<12} {'state':<9} {'value':>10} {'epochs':>6}  params")
    for t in info["trials"]:
        echo(f"{t['number']:>3}  {t['job'] or '-':<12} {t['state']:<9} {_value(t):>10} {t['epochs']:>6g}  {_params(t)}")
    if any(trial_value(t)[1] is not None for t in info["trials"]):
        echo("* its last reported value, at that epoch: the trial has not run to the end (running, pruned, stopped)")
    echo(_best(info))


def trial_value(trial: Mapping[str, Any]) -> tuple[float | None, int | None]:
    """A trial's value: its objective's final value, with ``None``; else, for a trial that has not run to
    the end (running, pruned, stopped), its last reported value and the epoch it was reported at; else
    ``(None, None)``."""
    if isinstance(trial.get("value"), (int, float)):
        return float(trial["value"]), None
    reports = trial.get("reports") or {}
    numbered = [(int(e), v) for e, v in reports.items() if str(e).isdigit() and isinstance(v, (int, float))]
    if not numbered:
        return None, None
    epoch, value = max(numbered)
    return float(value), epoch


def _value(trial: Mapping[str, Any]) -> str:
    value, epoch = trial_value(trial)
    if value is None:
        return "-"
    return f"{value:.4f}" if epoch is None else f"{value:.4f}*"


def _params(trial: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={_short(v)}" for k, v in trial["params"].items())


def _best(info: StudyView) -> str:
    best = info["best"]
    if not best:
        return "best: none complete yet"
    return f"best: trial {best['number']} (job {best['job']}) {info['objective']} {best['value']:.4f}"


def _short(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


#: Seconds between two looks at a watched study.
WATCH_POLL_S = 1.0


@study_app.command("watch")
@guard
@admin_options
def study_watch(study: str, *, settings: Settings) -> None:
    """Follow a study's trials until it ends (or Ctrl-C): a line each time a trial starts, reports or
    ends (state, params, last value, best so far), then the study as `study show` prints it. Exits 0
    when the study completed, 1 when it was stopped."""
    shown: dict[int, tuple] = {}
    try:
        with admin_client(settings) as client:
            while True:
                info = views.study(client, study)
                for t in info["trials"]:
                    seen = (t["state"], t["job"], trial_value(t))
                    if shown.get(t["number"]) != seen:
                        shown[t["number"]] = seen
                        echo(_trial_line(t, info))
                if info["state"] != StudyState.RUNNING:
                    break
                time.sleep(WATCH_POLL_S)
    except KeyboardInterrupt:
        echo(f"stopped watching: study {study} goes on (busctl study show {study})", err=True)
        raise typer.Exit(130) from None
    echo("")
    _print_study(info)
    if info["state"] != "complete":
        raise typer.Exit(1)


def _trial_line(trial: ShownTrial, info: StudyView) -> str:
    """``HH:MM:SS trial N (JOB) STATE OBJECTIVE VALUE[ at epoch E] PARAMS | best: ...``."""
    value, epoch = trial_value(trial)
    if value is None:
        said = "no value yet"
    else:
        said = f"{info['objective']} {value:.4f}" + (f" at epoch {epoch}" if epoch is not None else "")
    return (
        f"{time.strftime('%H:%M:%S')} trial {trial['number']} ({trial['job'] or 'no job'}) {trial['state']}: "
        f"{said}; {_params(trial)} | {_best(info)}"
    )


@study_app.command("stop")
@guard
@admin_options
def study_stop(study: str, *, settings: Settings, json: Json = False) -> None:
    """Stop a study: no new trials; its running trials are stopped (they checkpoint)."""
    with admin_client(settings) as client:
        detail = client.request(StopStudy(study=study)).detail
    print_json(detail) if json else echo(f"study {study} stopped")


@guard
@admin_options
def studies(*, settings: Settings, json: Json = False) -> None:
    """List studies, newest first."""
    with admin_client(settings) as client:
        rows = views.studies(client)
    if json:
        print_json(rows)
        return
    echo(f"{'study':<10} {'state':<9} {'trials':<28} {'epochs':>12}  best")
    for s in rows:
        counts = " ".join(f"{n} {k}" for k, n in sorted(s["counts"].items())) or "-"
        best = f"{s['objective']} {s['best']['value']:.4f} (trial {s['best']['number']})" if s["best"] else "-"
        echo(
            f"{s['id']:<10} {s['state']:<9} {counts:<28} {s['epochs_trained']:>5g}/{s['epochs_budget'] if s['epochs_budget'] is not None else '-':<6}  {best}"
        )


# -- evaluation tasks and current models -----------------------------------------------------------


def is_model_ref(model: str | None) -> TypeGuard[str]:
    """Whether ``busctl submit --evaluate --model`` names a stored model: a job id, a .safetensors
    file, or any file there is (``busctl job model -o`` writes whatever name it is given)."""
    return bool(model and (_JOB_ID.match(model) or model.endswith(".safetensors") or Path(model).is_file()))


def looks_like_model_ref(model: str) -> bool:
    """Whether ``model``, not a stored model (:func:`is_model_ref`), was meant as one: a path, or a
    job id mistyped. A built-in's name or ``package.module:factory`` is a model to train."""
    return "/" in model or "\\" in model or bool(re.match(r"^j[0-9a-f]{4,}$", model))


def evaluation_task(
    model: str, dataset: str, split: str | None, arch: str | None, evaluator: str | None = None
) -> tuple[dict, list[bytes]]:
    """The spec (and the uploaded weights, for a file) of an evaluation task of ``model``: a job id,
    or a safetensors file. With ``evaluator`` the provider's evaluator scores it on the test split, so
    the file need not say which model it holds."""
    split = split or ("test" if evaluator else "val")
    if split not in ("val", "test"):
        fail(f"--split must be val (scored on a trainer) or test (on the provider), got {split!r}", 2)
    if evaluator and split != "test":
        fail("an evaluator scores on the provider's test split: --split test (or leave --split out)", 2)
    if evaluator and arch:  # the evaluator builds what it scores: an architecture would go unused
        fail("--arch names the built-in model that scores the weights; --evaluator scores them itself: give one", 2)
    from libbus.jobs.weights import weights_digest  # noqa: PLC0415 - keeps busctl start-up light

    spec = {"task": "evaluate", "dataset": dataset, "split": split, "evaluate": False}
    if _JOB_ID.match(model):
        return {**spec, "model_from": model}, []
    path = Path(model)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        fail(f"model file {path} does not exist (--model takes a job id or a .safetensors file)", 2)
    except OSError as err:
        fail(f"cannot read model file {path}: {err.strerror or err}", 2)
    try:
        weights_digest(data)
        meta = _metadata(data)
    except ValueError as err:
        fail(f"{path}: {err}; --model takes a job id or a .safetensors file", 2)
    upload = {**spec, "model_from": "upload"}
    if evaluator and not arch:  # the evaluator builds what it scores: no architecture to name
        return upload, [data]
    name = arch or meta.get("model")
    if not name:
        made_by = f" of entrypoint {meta['entrypoint']}" if meta.get("entrypoint") else ""
        fail(
            f"{path} holds weights{made_by} but does not say which model builds them: score them with "
            "--evaluator package.module:function (on the provider's test split), or name the model with "
            "--arch (mlp, cnn, tiny-lm, package.module:factory)",
            2,
        )
    try:  # written by trainers since studies came; an older file's model is built with default arguments
        kwargs = orjson.loads(meta.get("model_kwargs") or "{}") if not arch else {}
    except orjson.JSONDecodeError:
        kwargs = {}
    return {**upload, "model": name, "model_kwargs": kwargs if isinstance(kwargs, dict) else {}}, [data]


def _metadata(data: bytes) -> dict[str, str]:
    """A safetensors blob's string metadata (checked to be one by :func:`weights_digest` first)."""
    size = int.from_bytes(data[:8], "little")
    meta = orjson.loads(data[8 : 8 + size]).get("__metadata__") or {}
    return {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}


def current_model(job: str, out: Path, settings: Settings) -> None:
    """``busctl job model ID --current``: the running job's weights, copied between two steps."""
    from services.atomic import write_atomic  # noqa: PLC0415 - keeps busctl start-up light
    from services.router.jobs import EVAL_ACK_TIMEOUT_S  # noqa: PLC0415

    with admin_client(settings) as client:
        client.hello()
        reply = client.request(
            ControlJob(job=job, command=JobCommand.MODEL), timeout_s=EVAL_ACK_TIMEOUT_S + 15, retries=0
        )
    if not isinstance(reply, Model):
        fail(f"job {job}: the trainer sent no weights: {reply.detail.get('error', reply.detail)}")
    data = bytes(frame_buffer(reply.frames[0]))
    digest = hashlib.sha256(data).hexdigest()
    if digest != reply.sha256:
        fail(f"model of {job} arrived with sha256 {digest}, expected {reply.sha256}; nothing written")
    write_atomic(out, data)
    echo(f"{out}: {len(data)} bytes, sha256 {digest}, step {reply.step} (epoch {reply.epoch})")
    echo(weights_line(data))


def weights_line(data: bytes) -> str:
    """The weights digest of a downloaded model, and what it is for."""
    from libbus.jobs.weights import weights_digest  # noqa: PLC0415 - keeps busctl start-up light

    try:
        return f"weights digest {weights_digest(data)} (equal for equal tensors, whatever the file's metadata)"
    except ValueError as err:
        return f"weights digest: none ({err})"
