"""The busctl command line. Every command builds its settings once (file < env < flags) and calls
into libbus/services; errors print one line and exit non-zero."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated

import typer

from libbus.config import Settings, load_settings
from libbus.jobs import JOB_STATES, SETTABLE
from libbus.messages import ControlJob, GetJob, GetModel, ListJobs, ListPeers, Stats, SubmitJob, frame_buffer

from . import tables
from .common import admin_client, fail, guard, print_json, settings_from, setup_logging
from .options import (
    Bind,
    Config,
    Json,
    LogLevel,
    MetricsBind,
    Name,
    ReadyFile,
    Router,
    SecretFile,
    StateDir,
    Token,
    admin_options,
)
from .studies import current_model, evaluation_task, is_model_ref, studies, study_app
from .tokens import keys_app, token_app
from .units import install_units
from .watch import watch_job

app = typer.Typer(
    name="busctl",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="batchbus: stream training data to PyTorch trainers. (Not systemd's busctl: "
    "this one lives in the project's environment.)",
)
start_app = typer.Typer(no_args_is_help=True, help="Run a service in the foreground (systemd-friendly).")
job_app = typer.Typer(no_args_is_help=True, help="Inspect or control one job.")
config_app = typer.Typer(no_args_is_help=True, help="Show the effective settings.")
shm_app = typer.Typer(no_args_is_help=True, help="Shared-memory rings on this host.")
app.add_typer(start_app, name="start")
app.add_typer(job_app, name="job")
app.add_typer(token_app, name="token")
app.add_typer(config_app, name="config")
app.add_typer(shm_app, name="shm")
app.add_typer(keys_app, name="keys")
app.add_typer(study_app, name="study")
app.command("studies")(studies)
app.command("install-units")(guard(install_units))


def _write_ready(path: Path | None, endpoint: str) -> None:
    if path is not None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(endpoint + "\n")
        tmp.replace(path)


# -- services ------------------------------------------------------------------------------------


@start_app.command("router")
@guard
def start_router(
    config: Config = None,
    router: Router = None,
    bind: Bind = None,
    secret_file: SecretFile = None,
    state_dir: StateDir = None,
    db: Annotated[str | None, typer.Option(help="Job database file.")] = None,
    name: Name = None,
    log_level: LogLevel = None,
    ready_file: ReadyFile = None,
    heartbeat_ms: Annotated[int | None, typer.Option(help="Heartbeat interval.")] = None,
    metrics_bind: MetricsBind = None,
) -> None:
    """The control plane: registration, discovery, the job queue (SQLite), commands, stats."""
    import threading

    from services import runtime
    from services.router.app import RouterService

    s = settings_from(
        config,
        router=router,
        bind=bind,
        secret_file=secret_file,
        state_dir=state_dir,
        db=db,
        name=name,
        log_level=log_level,
        heartbeat_ms=heartbeat_ms,
        metrics_bind=metrics_bind,
    )
    setup_logging(s.log_level)
    stop, notify = threading.Event(), runtime.notifier()
    runtime.install_signal_handlers(stop, notify)
    service = RouterService(s)
    endpoint = service.start()
    _write_ready(ready_file, endpoint)
    notify.ready(f"routing on {endpoint}; jobs in {s.db}")
    try:
        service.run(stop, notify.watchdog)
    finally:
        runtime.finish(notify)


@start_app.command("provider")
@guard
def start_provider(
    dataset: Annotated[
        list[str] | None,
        typer.Option(
            "--dataset", help="NAME=URI, repeatable (mock://mnist, mock://cifar10, dummy://?shape=1,28,28&n=1000)."
        ),
    ] = None,
    config: Config = None,
    router: Router = None,
    bind: Bind = None,
    advertise: Annotated[str | None, typer.Option(help="Data endpoint trainers connect to.")] = None,
    secret_file: SecretFile = None,
    state_dir: StateDir = None,
    token: Token = None,
    name: Name = None,
    log_level: LogLevel = None,
    ready_file: ReadyFile = None,
    heartbeat_ms: Annotated[int | None, typer.Option(help="Heartbeat interval.")] = None,
    metrics_bind: MetricsBind = None,
) -> None:
    """Serve datasets on a data socket and register them with the router."""
    import threading

    from services import runtime
    from services.provider.app import ProviderService

    s = settings_from(
        config,
        router=router,
        bind=bind,
        advertise=advertise,
        secret_file=secret_file,
        state_dir=state_dir,
        token=token,
        name=name,
        log_level=log_level,
        datasets=dataset or None,
        heartbeat_ms=heartbeat_ms,
        metrics_bind=metrics_bind,
    )
    setup_logging(s.log_level)
    stop, notify = threading.Event(), runtime.notifier()
    runtime.install_signal_handlers(stop, notify)
    service = ProviderService(s)
    endpoint = service.start()
    _write_ready(ready_file, endpoint)
    notify.ready(f"serving {', '.join(service.handler.datasets)} on {endpoint}")
    try:
        service.run(stop, notify.watchdog)
    finally:
        runtime.finish(notify)
    if service.link is not None and service.link.fatal is not None:
        fail(f"router refused this provider: {service.link.fatal}")


@start_app.command("trainer")
@guard
def start_trainer(
    config: Config = None,
    router: Router = None,
    secret_file: SecretFile = None,
    state_dir: StateDir = None,
    token: Token = None,
    name: Name = None,
    log_level: LogLevel = None,
    torch_threads: Annotated[int | None, typer.Option(help="torch intra-op threads.")] = None,
    heartbeat_ms: Annotated[int | None, typer.Option(help="Heartbeat interval.")] = None,
    metrics_bind: MetricsBind = None,
) -> None:
    """Take jobs from the router and train them on batches pulled from providers."""
    from services.trainer.app import run_trainer

    s = settings_from(
        config,
        router=router,
        secret_file=secret_file,
        state_dir=state_dir,
        token=token,
        name=name,
        log_level=log_level,
        torch_threads=torch_threads,
        heartbeat_ms=heartbeat_ms,
        metrics_bind=metrics_bind,
    )
    setup_logging(s.log_level)
    code = run_trainer(s)
    if code:
        raise typer.Exit(code)


@app.command()
@guard
def demo(
    epochs: Annotated[int, typer.Option(help="Epochs to train.")] = 2,
    dataset: Annotated[str, typer.Option(help="Dataset URI the demo provider serves.")] = "mock://mnist",
    model: Annotated[str, typer.Option(help="mlp or cnn.")] = "cnn",
    state_dir: StateDir = None,
) -> None:
    """Router + provider + trainer on localhost; trains a CNN on mock MNIST and scores it on the provider."""
    from .demo import run_demo

    run_demo(epochs=epochs, uri=dataset, model=model, state_dir=state_dir)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@guard
def bench(ctx: typer.Context) -> None:
    """Same-host delivery benchmark: shm ring vs socket vs DataLoader vs raw pyzmq vs memcpy.

    Options are the benchmark's own (``busctl bench -h`` lists them); ``--json FILE``
    writes the results.
    """
    from benchmarks.delivery import main as bench_main

    bench_main(ctx.args)


# -- jobs ----------------------------------------------------------------------------------------


@app.command()
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
    epochs: Annotated[int | None, typer.Option()] = None,
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
    split: Annotated[
        str,
        typer.Option(help="With --evaluate --model JOB|FILE: val (a trainer scores it) or test (the provider does)."),
    ] = "val",
    arch: Annotated[
        str | None, typer.Option(help="With --evaluate --model FILE: its model, when the file does not say.")
    ] = None,
    *,
    settings: Settings,
    json: Json = False,
) -> None:
    """Queue a training job (or, with --evaluate --model JOB|FILE, an evaluation task); prints its id."""
    spec: dict = {}
    frames: list[bytes] = []
    if evaluate and is_model_ref(model):
        if not dataset:
            fail("an evaluation task needs --dataset NAME", 2)
        spec, frames = evaluation_task(model, dataset, split, arch)
        model = dataset = evaluate = None
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
    )
    spec.update({k: v for k, v in flags.items() if v is not None})
    if "dataset" not in spec:
        fail('say which dataset to train on: --dataset NAME or a job file with dataset = "NAME"', 2)
    s = settings
    with admin_client(s) as client:
        reply = client.request(SubmitJob(spec=spec, frames=frames))
    print_json({"job": reply.job}) if json else typer.echo(reply.job)


@app.command()
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
        reply = client.request(ListJobs(state=state, limit=limit, offset=offset))
    rows = reply.jobs
    print_json(rows) if json else tables.jobs(rows)
    if reply.note:  # the router cut the list to fit one reply
        typer.echo(f"note: {reply.note}", err=True)


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
        reply = client.request(GetJob(job=job, progress=max(0, progress), events=events, offset=offset))
    info = reply.job
    print_json(info) if json else tables.job(info)
    if reply.note:  # the router cut the history to fit one reply
        typer.echo(f"note: {reply.note}", err=True)


def _control(job: str, command: str, args: dict, settings: Settings, json: bool) -> None:
    """Send one ControlJob and print the acknowledgement (the trainer's, or the router's own)."""
    s = settings
    with admin_client(s) as client:
        detail = client.request(ControlJob(job=job, command=command, args=args)).detail
    if json:
        print_json(detail)
        return
    line = f"{job}: {detail.get('state')}"
    if detail.get("acked"):
        line += f" (acknowledged by {detail.get('trainer')} in {detail.get('ack_ms', 0):.0f} ms)"
    ckpt = detail.get("checkpoint")
    if ckpt:
        line += f"\ncheckpoint step {ckpt['step']} epoch {ckpt['epoch']}: {ckpt['path']} sha256 {ckpt['sha256']}"
    if detail.get("error"):
        line += f"\nrefused by the trainer: {detail['error']}"
    typer.echo(line)


@job_app.command("stop")
@guard
@admin_options
def job_stop(job: str, *, settings: Settings, json: Json = False) -> None:
    """Stop a job; a running one checkpoints first (`busctl job resume` continues it)."""
    _control(job, "stop", {}, settings, json)


@job_app.command("pause")
@guard
@admin_options
def job_pause(job: str, *, settings: Settings, json: Json = False) -> None:
    """Pause a job: its trainer keeps it (and its lease) but trains on no more batches."""
    _control(job, "pause", {}, settings, json)


@job_app.command("resume")
@guard
@admin_options
def job_resume(job: str, *, settings: Settings, json: Json = False) -> None:
    """Resume a paused job, or queue a stopped or failed one again from its last checkpoint."""
    _control(job, "resume", {}, settings, json)


@job_app.command("checkpoint")
@guard
@admin_options
def job_checkpoint(job: str, *, settings: Settings, json: Json = False) -> None:
    """Make the trainer write a checkpoint now; prints its path and sha256."""
    _control(job, "checkpoint", {}, settings, json)


@job_app.command("set")
@guard
@admin_options
def job_set(
    job: str,
    values: Annotated[list[str], typer.Argument(help=f"NAME=VALUE pairs; names: {', '.join(SETTABLE)}.")],
    *,
    settings: Settings,
    json: Json = False,
) -> None:
    """Change hyper-parameters of a job, e.g. `busctl job set J lr=0.01 weight_decay=1e-4`."""
    args = {}
    for pair in values:
        name, sep, value = pair.partition("=")
        try:
            args[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            fail(f"expected NAME=NUMBER such as lr=0.01, got {pair!r}", 2)
    _control(job, "set", args, settings, json)


@job_app.command("eval")
@guard
@admin_options
def job_eval(job: str, *, settings: Settings, json: Json = False) -> None:
    """Score a running job's current weights on its provider's private test split; training pauses
    only for the copy of the weights."""
    from .evaluate import evaluate_job

    evaluate_job(settings, job, json=json)


@job_app.command("model")
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


@job_app.command("watch")
@guard
@admin_options
def job_watch(job: str, *, settings: Settings) -> None:
    """Follow a job with a progress bar until it ends; exit 0 only if it succeeded."""
    s = settings
    with admin_client(s) as client:
        final = watch_job(client, job)
    if final["state"] != "succeeded":
        raise typer.Exit(1)


# -- cluster -------------------------------------------------------------------------------------


@app.command()
@guard
@admin_options
def queues(*, settings: Settings, json: Json = False) -> None:
    """Every service's queue and traffic metrics, as carried on heartbeats."""
    s = settings
    with admin_client(s) as client:
        services = client.request(Stats()).services
    print_json(services) if json else tables.queues(services)


@app.command()
@guard
@admin_options
def top(
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between refreshes.")] = 2.0,
    once: Annotated[
        bool, typer.Option("--once", help="Print one frame (two snapshots --interval apart) and exit.")
    ] = False,
    *,
    settings: Settings,
    json: Annotated[bool, typer.Option("--json", help="With --once: the frame's data.")] = False,
) -> None:
    """A live view of providers, trainers, jobs and pipeline stages until Ctrl-C (docs/operations.md)."""
    from .top import top_command

    if json and not once:
        fail("--json prints one frame: use it with --once", 2)
    top_command(settings, interval=interval, once=once, json=json)


@app.command()
@guard
@admin_options
def control(
    provider: Annotated[str, typer.Argument(help="Provider name (busctl peers).")],
    stage: Annotated[str, typer.Argument(help="A stage of one of its pipeline datasets.")],
    command: Annotated[str, typer.Argument(help="stats; random stages also get, set, reset.")],
    args: Annotated[list[str] | None, typer.Argument(help="key=value, e.g. seed=3 epoch=2 (set).")] = None,
    dataset: Annotated[str, typer.Option(help="The pipeline dataset, when several have STAGE.")] = "",
    *,
    settings: Settings,
    json: Json = False,
) -> None:
    """Send a control command to one stage of a provider's pipeline dataset (docs/operations.md)."""
    from .pipeline import control_command

    control_command(settings, provider, stage, command, args or [], dataset=dataset, json=json)


@app.command()
@guard
@admin_options
def peers(*, settings: Settings, json: Json = False) -> None:
    """Providers, trainers and admins connected to the router."""
    s = settings
    with admin_client(s) as client:
        rows = client.request(ListPeers()).peers
    print_json(rows) if json else tables.peers(rows)


@app.command("datasets")
@guard
@admin_options
def datasets(*, settings: Settings, json: Json = False) -> None:
    """Every dataset the providers serve: providers, kind, splits, sample shape and dtype, classes."""
    from .data import datasets_command

    datasets_command(settings, json=json)


@app.command("fetch")
@guard
@admin_options
def fetch(
    dataset: Annotated[str, typer.Argument(help="Dataset name (or remote://NAME).")],
    split: Annotated[str, typer.Option(help="train or val (test never leaves its provider).")] = "train",
    indices: Annotated[
        str,
        typer.Option(
            help="Ranges START:STOP[:STEP] such as 0:8 or 0:64:4, single indices, comma-joined: 3,7,9 or 0:4,100."
        ),
    ] = "0:8",
    out: Annotated[
        Path | None, typer.Option(help="Save instead of printing: .npz (x, y, indices) or .npy (x only).")
    ] = None,
    epoch: Annotated[int, typer.Option(min=0, help="The epoch whose augmentations a pipeline dataset applies.")] = 0,
    *,
    settings: Settings,
    json: Json = False,
) -> None:
    """Samples of a dataset exactly as a trainer receives them: shape, dtype, labels, per-sample summary."""
    from .data import fetch_command

    fetch_command(settings, dataset, split, indices, out=out, json=json, epoch=epoch)


@shm_app.command("ls")
@guard
def shm_ls(json: Json = False) -> None:
    """Every batchbus ring in /dev/shm: owner pid, whether it still runs, size."""
    from shm import list_segments

    rows = [seg.as_dict() for seg in list_segments()]
    print_json(rows) if json else tables.segments(rows)


@shm_app.command("gc")
@guard
def shm_gc(json: Json = False) -> None:
    """Remove rings whose owner is gone (a killed trainer's). Rings of live processes stay."""
    from shm import collect_garbage

    rows = [seg.as_dict() for seg in collect_garbage()]
    if json:
        print_json(rows)
    else:
        total = sum(r["size"] for r in rows)
        typer.echo(
            f"removed {len(rows)} ring(s), {total / 2**20:.1f} MiB"
            + "".join(f"\n  {r['name']} (pid {r['pid']})" for r in rows)
        )


@config_app.command("show")
@guard
def config_show(config: Config = None, json: Json = False) -> None:
    """Every setting, its effective value and where that value came from."""
    settings, sources = load_settings(config_file=config)
    values = settings.redacted()  # a token is a password: never printed
    if json:
        print_json({k: {"value": v, "source": sources[k]} for k, v in values.items()})
    else:
        tables.settings(values, sources)


def main() -> None:
    app()
