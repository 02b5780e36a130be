"""``busctl submit``, ``busctl jobs`` and ``busctl job show|watch|metrics|logs|pause|resume|checkpoint|stop|set|model|eval|samples|skip``:
queue jobs, list them, inspect and control one."""

from __future__ import annotations

import time
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from libbus.config import Settings
from libbus.connect.client import Client
from libbus.constants import MAX_LOCATE_INDICES
from libbus.errors import TooLarge
from libbus.jobs.commands import JobCommand
from libbus.jobs.spec import JOB_STATES, SETTABLE
from libbus.jobs.state import JobState
from libbus.order.epochs import Cursor
from libbus.security.curve import curve_key_of
from libbus.wire.messages import (
    ControlJob,
    GetJob,
    GetJobSamples,
    GetModel,
    LocateSamples,
    Ok,
    Resolve,
    SkipJob,
    SubmitJob,
    frame_buffer,
)
from services import views

if TYPE_CHECKING:
    from services.router.store import JobView

from . import tables
from .connection import admin_client
from .options import Json, admin_options
from .output import echo, fail, guard, print_json, printable
from .studies import current_model, evaluation_task, is_model_ref, looks_like_model_ref, weights_line
from .watch import watch_job

__all__ = ["job_app", "submit", "jobs"]

job_app = typer.Typer(no_args_is_help=True, help="Inspect or control one job.")


@guard
@admin_options
def submit(
    job_file: Annotated[Path | None, typer.Argument(help="TOML job file (flags override it).")] = None,
    dataset: Annotated[str | None, typer.Option(help="Dataset name (or remote://NAME).")] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="mlp, cnn, tiny-lm or module:factory; with --evaluate a stored model to score: a job id or FILE.safetensors."
        ),
    ] = None,
    epochs: Annotated[
        int | None, typer.Option(help="Epochs to train (an entrypoint job: its params.epochs, as job.params reads it).")
    ] = None,
    batch_size: Annotated[int | None, typer.Option()] = None,
    lr: Annotated[float | None, typer.Option()] = None,
    optimizer: Annotated[str | None, typer.Option(help="sgd or adam.")] = None,
    seed: Annotated[int | None, typer.Option()] = None,
    shuffle: Annotated[str | None, typer.Option(help="none, full or block.")] = None,
    block_size: Annotated[int | None, typer.Option(help="Samples per block of --shuffle block.")] = None,
    evaluate: Annotated[
        bool | None, typer.Option("--evaluate/--no-evaluate", help="Score on the provider's test split at the end.")
    ] = None,
    world_size: Annotated[int | None, typer.Option(help="Trainers that train the job together (a gang).")] = None,
    elastic: Annotated[
        bool | None, typer.Option("--elastic/--no-elastic", help="A gang of --min/--max-world-size trainers.")
    ] = None,
    min_world_size: Annotated[
        int | None, typer.Option(help="With --elastic: the fewest trainers it starts on.")
    ] = None,
    max_world_size: Annotated[int | None, typer.Option(help="With --elastic: the most trainers it gathers.")] = None,
    split: Annotated[
        str | None,
        typer.Option(
            help="With --evaluate --model JOB|FILE: val (a trainer scores it; the default) or test (the provider "
            "does; the default with --evaluator)."
        ),
    ] = None,
    arch: Annotated[
        str | None,
        typer.Option(
            help="With --evaluate --model FILE: its model, when the file does not say (not with --evaluator)."
        ),
    ] = None,
    entrypoint: Annotated[
        str | None,
        typer.Option(help="Your training function, package.module:function (docs/jobs.md); its trainer must allow it."),
    ] = None,
    param: Annotated[
        list[str] | None, typer.Option("--param", help="NAME=VALUE for job.params (a TOML value or text); repeat it.")
    ] = None,
    model_from: Annotated[
        str | None,
        typer.Option(
            help="Start training from this model: a job's id (its final model, or while it has not succeeded "
            "its latest checkpoint's weights), or a FILE.safetensors (uploaded)."
        ),
    ] = None,
    train_range: Annotated[
        str | None, typer.Option(help="START:STOP: train on these records of the train split only.")
    ] = None,
    evaluator: Annotated[
        str | None,
        typer.Option(
            help="module:function that scores the weights on the provider's test split (its evaluator_modules must allow it)."
        ),
    ] = None,
    *,
    settings: Settings,
    json: Json = False,
) -> None:
    """Queue a training job (or, with --evaluate --model JOB|FILE, an evaluation task); prints its id."""
    spec: dict = {}
    frames: list[bytes] = []
    if evaluate and model and (is_model_ref(model) or looks_like_model_ref(model) or split or arch):
        # scoring a stored model (an evaluation task), not training one and scoring it at the end
        if not is_model_ref(model):
            fail(
                f"--evaluate --model {model!r}: not a job id (j and 10 hex digits) nor a readable file; an "
                "evaluation task scores a succeeded job's model or a .safetensors file (busctl job model -o FILE)",
                2,
            )
        if not dataset:
            fail("an evaluation task needs --dataset NAME", 2)
        spec, frames = evaluation_task(model, dataset, split, arch, evaluator)
        model = dataset = evaluate = None
    elif split or arch:
        fail("--split and --arch go with --evaluate --model JOB|FILE (an evaluation task)", 2)
    if job_file is not None:
        try:
            spec = tomllib.loads(job_file.read_text())
        except FileNotFoundError:
            fail(f"job file {job_file} does not exist", 2)
        except tomllib.TOMLDecodeError as err:
            fail(f"job file {job_file} is not valid TOML: {err}", 2)
        spec = spec.get("job", spec)
    flags = dict(
        dataset=dataset,
        model=model,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        optimizer=optimizer,
        seed=seed,
        evaluate=evaluate,
        shuffle=shuffle,
        block_size=block_size,
        world_size=world_size,
        elastic=elastic,
        min_world_size=min_world_size,
        max_world_size=max_world_size,
        evaluator=evaluator,
    )
    spec.update({k: v for k, v in flags.items() if v is not None})
    if entrypoint is not None:
        spec["entrypoint"] = entrypoint
    if param:
        spec["params"] = {**spec.get("params", {}), **_pairs(param)}
    if spec.get("entrypoint") and epochs is not None:
        # a function reads its epochs from job.params (docs/jobs.md): --epochs is that param
        if "epochs" in spec.get("params", {}) and spec["params"]["epochs"] != epochs:
            fail(f"--epochs {epochs} and params.epochs {spec['params']['epochs']} disagree: give one", 2)
        spec["params"] = {**spec.get("params", {}), "epochs": epochs}
        del spec["epochs"]
    if model_from is not None:
        spec["model_from"], frames = _model_source(model_from)
    if train_range is not None:
        start, sep, stop = train_range.partition(":")
        if not sep or not start.strip().isdigit() or not stop.strip().isdigit():
            fail(f"--train-range is START:STOP, e.g. 0:50000, got {train_range!r}", 2)
        spec["train_range"] = [int(start), int(stop)]
    if "dataset" not in spec:
        fail('say which dataset to train on: --dataset NAME or a job file with dataset = "NAME"', 2)
    s = settings
    with admin_client(s) as client:
        reply = client.request(SubmitJob(spec=spec, frames=frames))
    print_json({"job": reply.job} | ({"note": reply.note} if reply.note else {})) if json else typer.echo(reply.job)
    if reply.note and not json:  # what the router could not check (no trainer connected to ask)
        typer.echo(f"note: {reply.note}", err=True)


@guard
@admin_options
def jobs(
    state: Annotated[str | None, typer.Option(help=f"Only jobs in this state: {', '.join(JOB_STATES)}.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many, newest first.")] = 50,
    offset: Annotated[int, typer.Option(min=0, help="Skip this many newest (the next page).")] = 0,
    *,
    settings: Settings,
    json: Json = False,
) -> None:
    """List jobs, newest first, a page at a time (--limit, --offset)."""
    with admin_client(settings) as client:
        rows, note = views.jobs(client, state, limit, offset)
    print_json(rows) if json else tables.jobs(rows)
    if note:  # the router cut the list to fit one reply
        typer.echo(f"note: {note}", err=True)


@job_app.command("show")
@guard
@admin_options
def job_show(
    job: str,
    *,
    settings: Settings,
    json: Json = False,
    progress: Annotated[int, typer.Option(help="Also the last N progress reports.")] = 0,
    events: Annotated[int, typer.Option(min=1, help="The newest N events and checkpoint records.")] = 200,
    offset: Annotated[int, typer.Option(min=0, help="Skip this many newest events (the next page).")] = 0,
) -> None:
    """State, spec, progress, checkpoints, events and result of one job (events a page at a time)."""
    with admin_client(settings) as client:
        info, note = views.job(client, job, progress, events, offset)
    print_json(info) if json else tables.job(info)
    if note:  # the router cut the history to fit one reply
        typer.echo(f"note: {note}", err=True)


def _control(job: str, command: JobCommand, args: dict, settings: Settings, json: bool) -> None:
    """Send one ControlJob and print the acknowledgement (the trainer's, or the router's own)."""
    s = settings
    with admin_client(s) as client:
        reply = client.request(ControlJob(job=job, command=command, args=args))
    if not isinstance(reply, Ok):  # (a Model answers only `model`, which cli/studies.py sends)
        fail(f"the router answered {command} with {reply.type}")
    detail = reply.detail
    if json:
        print_json(detail)
        return
    line = f"{job}: {detail.get('state')}"
    if detail.get("acked"):
        line += f" (acknowledged by {detail.get('trainer')} in {detail.get('ack_ms', 0):.0f} ms)"
    ckpt = detail.get("checkpoint")
    if ckpt:
        line += f"\ncheckpoint step {ckpt['step']} ({Cursor.of_checkpoint(ckpt).shown()}): {ckpt['path']} sha256 {ckpt['sha256']}"
    if detail.get("error"):
        line += f"\nrefused by the trainer: {detail['error']}"
    echo(line)  # the trainer's acknowledgement and error: peer text


@job_app.command(JobCommand.STOP.value)
@guard
@admin_options
def job_stop(job: str, *, settings: Settings, json: Json = False) -> None:
    """Stop a job; a running one checkpoints first (`busctl job resume` continues it)."""
    _control(job, JobCommand.STOP, {}, settings, json)


@job_app.command(JobCommand.PAUSE.value)
@guard
@admin_options
def job_pause(job: str, *, settings: Settings, json: Json = False) -> None:
    """Pause a job: its trainer keeps it (and its lease) but trains on no more batches."""
    _control(job, JobCommand.PAUSE, {}, settings, json)


@job_app.command(JobCommand.RESUME.value)
@guard
@admin_options
def job_resume(job: str, *, settings: Settings, json: Json = False) -> None:
    """Resume a paused job, or queue a stopped or failed one again from its last checkpoint."""
    _control(job, JobCommand.RESUME, {}, settings, json)


@job_app.command(JobCommand.CHECKPOINT.value)
@guard
@admin_options
def job_checkpoint(job: str, *, settings: Settings, json: Json = False) -> None:
    """Make the trainer write a checkpoint now; prints its path and sha256."""
    _control(job, JobCommand.CHECKPOINT, {}, settings, json)


@job_app.command(JobCommand.SET.value)
@guard
@admin_options
def job_set(
    job: str,
    values: Annotated[
        list[str],
        typer.Argument(help=f"NAME=VALUE pairs; a built-in job's {', '.join(SETTABLE)}, an entrypoint's params."),
    ],
    *,
    settings: Settings,
    json: Json = False,
) -> None:
    """Change hyper-parameters of a job, e.g. `busctl job set J lr=0.01 weight_decay=1e-4` (an
    entrypoint job: any of its params, seen by job.params from its next step)."""
    _control(job, JobCommand.SET, _pairs(values), settings, json)


def _model_source(ref: str) -> tuple[str, list[bytes]]:
    """``model_from`` and the frames to send: a job id as it is, a safetensors file uploaded."""
    if not ref.endswith(".safetensors"):
        return ref, []
    try:
        return "upload", [Path(ref).read_bytes()]
    except OSError as err:
        fail(f"cannot read model file {ref}: {err.strerror or err}", 2)


def _pairs(pairs: list[str]) -> dict:
    """``NAME=VALUE`` pairs; a value is read as TOML (``0.01``, ``true``, ``[1, 2]``), else as text."""
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            fail(f"expected NAME=VALUE such as lr=0.01, got {pair!r}", 2)
        try:
            out[name] = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            out[name] = value.strip()
    return out


@job_app.command("logs")
@guard
@admin_options
def job_logs(
    job: str,
    attempt: Annotated[int, typer.Option(help="Which attempt (0 is the first); the latest by default.")] = -1,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until the job ends.")] = False,
    *,
    settings: Settings,
    json: Json = False,
) -> None:
    """What an entrypoint job's function printed (stdout and stderr), per attempt."""
    import time

    after = 0
    with admin_client(settings) as client:
        while True:
            reply = views.job_logs(client, job, attempt, after)
            if json:
                print_json(reply)
            else:
                if after == 0 and reply["dropped"]:
                    typer.echo(f"[{reply['dropped']} earlier line(s) of attempt {reply['attempt']} no longer kept]")
                for line in reply["lines"]:
                    typer.echo(printable(line, keep="\t"))
            attempt, after = reply["attempt"], reply["next"]
            if reply["lines"]:
                continue
            if not follow:
                return
            state = client.request(GetJob(job=job, events=0)).job.get("state")
            if state is not None and JobState(state).terminal:
                return
            time.sleep(1.0)


@job_app.command(JobCommand.EVAL.value)
@guard
@admin_options
def job_eval(job: str, *, settings: Settings, json: Json = False) -> None:
    """Score a running job's current weights on its provider's private test split; training pauses
    only for the copy of the weights."""
    from .evaluate import evaluate_job

    evaluate_job(settings, job, json=json)


@job_app.command(JobCommand.MODEL.value)
@guard
@admin_options
def job_model(
    job: str,
    out: Annotated[Path, typer.Option("-o", "--out", help="Where to write the safetensors file.")],
    current: Annotated[
        bool, typer.Option("--current", help="A running job's current weights, copied between two steps.")
    ] = False,
    *,
    settings: Settings,
) -> None:
    """Download the final weights of a succeeded job (safetensors), checked against their sha256."""
    if current:
        return current_model(job, out, settings)
    import hashlib

    from services.atomic import write_atomic

    s = settings
    with admin_client(s) as client:
        reply = client.request(GetModel(job=job))
    frame = reply.frames[0]
    data = bytes(frame_buffer(frame))
    digest = hashlib.sha256(data).hexdigest()
    if digest != reply.sha256:
        fail(f"model of {job} arrived with sha256 {digest}, expected {reply.sha256}; nothing written")
    write_atomic(out, data)
    typer.echo(f"{out}: {len(data)} bytes, sha256 {digest}")
    typer.echo(weights_line(data))


@job_app.command("metrics")
@guard
@admin_options
def job_metrics(
    job: str,
    tensorboard: Annotated[
        Path | None,
        typer.Option(
            "--tensorboard",
            help="Also write them as TensorBoard event files under DIR/JOB (a study's trial: DIR/STUDY/trial-N).",
        ),
    ] = None,
    reports: Annotated[int, typer.Option(min=1, max=1000, help="The newest N progress reports.")] = 1000,
    *,
    settings: Settings,
    json: Json = False,
) -> None:
    """A job's metrics as the router keeps them: its epoch records and its progress reports (step, running
    loss, samples/s, data wait and its split by cause); with --tensorboard DIR, as event files too."""
    with admin_client(settings) as client:
        metrics, info = views.job_metrics(client, job, reports)
    history, kept = metrics["history"], metrics["reports"]
    run = None
    if tensorboard is not None:
        from libbus.jobs.tensorboard_events import export_job  # noqa: PLC0415 - tensorboardX imports torch

        try:
            run = export_job(tensorboard, {**info, "progress": {"history": history}}, kept)
        except (OSError, ValueError) as err:
            fail(f"no TensorBoard events written: {err}", 2 if isinstance(err, FileExistsError) else 1)
    if json:
        print_json(metrics)
    else:
        _print_metrics(info, history, kept)
        if run is not None:
            echo(f"TensorBoard events: {run} ({len(kept)} progress report(s), {len(history)} epoch record(s))")
    if metrics["note"]:  # the router cut the reports to fit one reply
        typer.echo(f"note: {metrics['note']}", err=True)


def _print_metrics(info: JobView, history: list[dict], kept: list[dict]) -> None:
    echo(f"{info['id']} {info['state']}: {len(history)} epoch record(s), {len(kept)} progress report(s) kept")
    for record in history:
        echo("  " + tables.epoch_line(record))
    if kept:
        echo(f"  {'time':<8} {'step':>7} {'epoch':>6} {'loss':>8} {'samples/s':>9} {'wait %':>6}  data wait split")
    for p in kept:
        loss = f"{p['loss']:.4f}" if isinstance(p.get("loss"), (int, float)) else "-"
        rate, wait = p.get("samples_per_s"), p.get("data_wait_pct")
        echo(
            f"  {time.strftime('%H:%M:%S', time.localtime(p.get('at', 0)))} {p.get('step', '-'):>7} "
            f"{tables.epoch_of(p):>6} {loss:>8} {f'{rate:.0f}' if isinstance(rate, (int, float)) else '-':>9} "
            f"{f'{wait:.1f}' if isinstance(wait, (int, float)) else '-':>6}  {tables.wait_split(p.get('data_wait_split'))}"
        )


@job_app.command("watch")
@guard
@admin_options
def job_watch(job: str, *, settings: Settings) -> None:
    """Follow a job with a progress bar until it ends; exit 0 only if it succeeded."""
    s = settings
    with admin_client(s) as client:
        final = watch_job(client, job)
    if final["state"] != JobState.SUCCEEDED:
        raise typer.Exit(1)


def parse_ranges(text: str, what: str) -> list[list[int]]:
    """``A:B[,C:D...]`` (or ``K``, meaning ``K:K+1``) as ``[[A, B], ...]``, each ``0 <= A < B``.

    Raises:
        typer.BadParameter: a malformed range, naming it and the form expected.
    """
    out = []
    for part in text.split(","):
        bits = part.strip().split(":")
        try:
            if len(bits) == 1:
                a = int(bits[0])
                b = a + 1
            elif len(bits) == 2:
                a, b = int(bits[0]), int(bits[1])
            else:
                raise ValueError
        except ValueError:
            raise typer.BadParameter(f"{what} {part.strip()!r} is not A:B (or one number K); e.g. 40:60") from None
        if not 0 <= a < b:
            raise typer.BadParameter(f"{what} {part.strip()!r} needs 0 <= A < B (A:B is A..B-1)")
        out.append([a, b])
    return out


@job_app.command("samples")
@guard
@admin_options
def job_samples(
    job: str,
    step: Annotated[int | None, typer.Option(help="The step (counted from 1) whose samples to list.")] = None,
    rank: Annotated[int | None, typer.Option(help="Only this rank's batch (default: every rank's).")] = None,
    epoch: Annotated[int | None, typer.Option(help="With --range: positions of this epoch's whole order.")] = None,
    range_: Annotated[str | None, typer.Option("--range", help="A:B, positions A..B-1 of --epoch's order.")] = None,
    where: Annotated[
        bool, typer.Option("--where", help="Also where each sample lives (file and offset, shard member, row).")
    ] = False,
    *,
    settings: Settings,
    json: Json = False,
) -> None:
    """Which samples made step K (every rank's batch), or positions A:B of an epoch's order: derived
    from the job's order and the segments of its attempts, not logged (docs/jobs.md). ``--where`` asks
    a provider of the job's dataset where each of them lives."""
    if (step is None) == (epoch is None):
        fail("give --step K, or --epoch E with --range A:B")
    if epoch is not None and range_ is None:
        fail("--epoch needs --range A:B (positions of that epoch's order)")
    if step is not None and range_ is not None:
        fail("--range goes with --epoch, not --step")
    msg = GetJobSamples(job=job, rank=-1 if rank is None else rank)
    if step is not None:
        msg.step = step
    else:
        ranges = parse_ranges(range_ or "", "range")
        if len(ranges) != 1:
            fail("--range takes one A:B")
        msg.epoch, msg.start, msg.stop = epoch or 0, ranges[0][0], ranges[0][1]
    with admin_client(settings) as client:
        reply = client.request(msg)
        if where:
            dataset = client.request(GetJob(job=job, events=0)).job["spec"]["dataset"]
            wanted = sorted({i for entry in reply.samples for i in entry["indices"]})
            places = locate_samples(settings, client, dataset, "train", wanted)
            for entry in reply.samples:
                entry["locations"] = [places[i] for i in entry["indices"]]
    if json:
        print_json({"job": reply.job, "n": reply.n, "samples": reply.samples, "note": reply.note})
    else:
        for entry in reply.samples:
            if "rank" in entry:
                head = f"step {step} rank {entry['rank']}/{entry['world_size']}"
                at = f"epoch {entry['epoch']} position {entry['position']}" if entry["indices"] else "no batch"
            else:
                head, at = f"epoch {entry['epoch']}", f"positions {entry['start']}:{entry['stop']}"
            if where:
                typer.echo(f"{head} ({at}):")
                for index, place in zip(entry["indices"], entry["locations"]):
                    typer.echo(f"  {index}  {printable(place) or '(the source does not say)'}")
            else:
                typer.echo(f"{head} ({at}): {' '.join(map(str, entry['indices']))}")
    if reply.note:
        typer.echo(f"note: {reply.note}", err=True)


def locate_samples(settings: Settings, router: Client, dataset: str, split: str, indices: list[int]) -> dict[int, str]:
    """Index → where it lives, asked of the first provider of ``dataset`` (Resolve; every provider of a
    name serves the same data) in requests of at most MAX_LOCATE_INDICES. Provider errors are raised."""
    resolved = router.request(Resolve(dataset=dataset))
    if not resolved.providers:
        fail(f"no provider serves {dataset!r} now: cannot say where its samples live")
    provider = resolved.providers[0]
    out: dict[int, str] = {}
    with Client(
        provider["endpoint"],
        router.identity,
        timeout_s=settings.request_timeout_s,
        retries=settings.request_retries,
        server_key=curve_key_of(provider),
    ) as client:
        parts = [indices[a : a + MAX_LOCATE_INDICES] for a in range(0, len(indices), MAX_LOCATE_INDICES)]
        while parts:
            part = parts.pop()
            try:
                found = client.request(LocateSamples(dataset=resolved.dataset, split=split, indices=part))
            except TooLarge:
                if len(part) == 1:
                    raise
                # long locations (a packed window's lines) that do not fit one reply: ask in halves
                parts += [part[len(part) // 2 :], part[: len(part) // 2]]
                continue
            out.update(zip(part, found.locations))
    return out


@job_app.command("skip")
@guard
@admin_options
def job_skip(
    job: str,
    steps: Annotated[str | None, typer.Option(help="A:B[,C:D]: the samples of steps A..B-1 (counted from 1).")] = None,
    samples: Annotated[str | None, typer.Option(help="A:B[,C:D]: sample indices A..B-1 of the split.")] = None,
    *,
    settings: Settings,
    json: Json = False,
) -> None:
    """Never train on these samples again: the job rewinds to its last checkpoint before the first
    skipped step and goes on without them, every other sample of the epoch still once (docs/jobs.md)."""
    if steps is None and samples is None:
        fail("give --steps A:B and/or --samples A:B")
    msg = SkipJob(
        job=job,
        steps=parse_ranges(steps, "step range") if steps else [],
        samples=parse_ranges(samples, "sample range") if samples else [],
    )
    with admin_client(settings) as client:
        reply = client.request(msg)
    detail = reply.detail if isinstance(reply, Ok) else {}
    if json:
        print_json(detail)
        return
    typer.echo(
        f"{job}: skips {detail.get('skipped', 0)} sample(s) from now on ({detail.get('ranges', 0)} range(s)); "
        f"{detail.get('rewind', '')}".rstrip("; ")
    )
