"""The busctl command line. Every command builds its settings once (file < env < flags) and calls
into libbus/services; errors print one line and exit non-zero."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Optional

import typer

from libbus.auth import ROLES, ensure_secret
from libbus.config import load_settings
from libbus.errors import BusError, ConfigError
from libbus.jobs import JOB_STATES, SETTABLE
from libbus.messages import ControlJob, GetJob, GetModel, ListJobs, ListPeers, Stats, SubmitJob

from . import tables
from .common import admin_client, fail, guard, print_json, settings_from, setup_logging
from .units import install_units
from .watch import watch_job

app = typer.Typer(name="busctl", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False,
                  help="batchbus: stream training data to PyTorch trainers. (Not systemd's busctl: "
                       "this one lives in the project's environment.)")
start_app = typer.Typer(no_args_is_help=True, help="Run a service in the foreground (systemd-friendly).")
job_app = typer.Typer(no_args_is_help=True, help="Inspect or control one job.")
token_app = typer.Typer(no_args_is_help=True, help="Mint and inspect tokens; create the cluster secret or signing key.")
config_app = typer.Typer(no_args_is_help=True, help="Show the effective settings.")
shm_app = typer.Typer(no_args_is_help=True, help="Shared-memory rings on this host.")
keys_app = typer.Typer(no_args_is_help=True, help="CURVE key pairs: encrypted, key-authenticated connections (docs/security.md).")
app.add_typer(start_app, name="start")
app.add_typer(job_app, name="job")
app.add_typer(token_app, name="token")
app.add_typer(config_app, name="config")
app.add_typer(shm_app, name="shm")
app.add_typer(keys_app, name="keys")
app.command("install-units")(guard(install_units))

# Options shared by many commands, declared once.
Config = Annotated[Optional[str], typer.Option("--config", help="TOML settings file (or BATCHBUS_CONFIG).")]
Router = Annotated[Optional[str], typer.Option("--router", help="Router address (or BATCHBUS_ROUTER).")]
SecretFile = Annotated[Optional[str], typer.Option("--secret-file", help="Cluster secret (or BATCHBUS_SECRET_FILE).")]
StateDir = Annotated[Optional[str], typer.Option("--state-dir", help="State directory (or BATCHBUS_STATE_DIR).")]
Token = Annotated[Optional[str], typer.Option("--token", help="Use this token (or BATCHBUS_TOKEN).")]
Bind = Annotated[Optional[str], typer.Option("--bind", help="Address to bind, e.g. tcp://0.0.0.0:5555.")]
Name = Annotated[Optional[str], typer.Option("--name", help="Service name (default role-host-pid).")]
LogLevel = Annotated[Optional[str], typer.Option("--log-level", help="DEBUG, INFO, WARNING, ERROR.")]
ReadyFile = Annotated[Optional[Path], typer.Option("--ready-file", help="Write the bound endpoint here once serving.")]
Json = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
MetricsBind = Annotated[Optional[str], typer.Option("--metrics-bind", help="Serve Prometheus /metrics on HOST:PORT (docs/operations.md).")]


def _write_ready(path: Path | None, endpoint: str) -> None:
    if path is not None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(endpoint + "\n")
        tmp.replace(path)


# -- services ------------------------------------------------------------------------------------

@start_app.command("router")
@guard
def start_router(config: Config = None, router: Router = None, bind: Bind = None, secret_file: SecretFile = None,
                 state_dir: StateDir = None, db: Annotated[Optional[str], typer.Option(help="Job database file.")] = None,
                 name: Name = None, log_level: LogLevel = None, ready_file: ReadyFile = None,
                 heartbeat_ms: Annotated[Optional[int], typer.Option(help="Heartbeat interval.")] = None,
                 metrics_bind: MetricsBind = None) -> None:
    """The control plane: registration, discovery, the job queue (SQLite), commands, stats."""
    from services import runtime
    from services.router.app import RouterService
    import threading
    s = settings_from(config, router=router, bind=bind, secret_file=secret_file, state_dir=state_dir, db=db,
                      name=name, log_level=log_level, heartbeat_ms=heartbeat_ms,
                      metrics_bind=metrics_bind)
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
def start_provider(dataset: Annotated[Optional[list[str]], typer.Option("--dataset", help="NAME=URI, repeatable (mock://mnist, mock://cifar10, dummy://?shape=1,28,28&n=1000).")] = None,
                   config: Config = None, router: Router = None, bind: Bind = None,
                   advertise: Annotated[Optional[str], typer.Option(help="Data endpoint trainers connect to.")] = None,
                   secret_file: SecretFile = None, state_dir: StateDir = None, token: Token = None,
                   name: Name = None, log_level: LogLevel = None, ready_file: ReadyFile = None,
                   heartbeat_ms: Annotated[Optional[int], typer.Option(help="Heartbeat interval.")] = None,
                   metrics_bind: MetricsBind = None) -> None:
    """Serve datasets on a data socket and register them with the router."""
    from services import runtime
    from services.provider.app import ProviderService
    import threading
    s = settings_from(config, router=router, bind=bind, advertise=advertise, secret_file=secret_file,
                      state_dir=state_dir, token=token, name=name, log_level=log_level,
                      datasets=dataset or None, heartbeat_ms=heartbeat_ms, metrics_bind=metrics_bind)
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
def start_trainer(config: Config = None, router: Router = None, secret_file: SecretFile = None,
                  state_dir: StateDir = None, token: Token = None, name: Name = None, log_level: LogLevel = None,
                  torch_threads: Annotated[Optional[int], typer.Option(help="torch intra-op threads.")] = None,
                  heartbeat_ms: Annotated[Optional[int], typer.Option(help="Heartbeat interval.")] = None,
                  metrics_bind: MetricsBind = None) -> None:
    """Take jobs from the router and train them on batches pulled from providers."""
    from services.trainer.app import run_trainer
    s = settings_from(config, router=router, secret_file=secret_file, state_dir=state_dir, token=token,
                      name=name, log_level=log_level, torch_threads=torch_threads, heartbeat_ms=heartbeat_ms,
                      metrics_bind=metrics_bind)
    setup_logging(s.log_level)
    code = run_trainer(s)
    if code:
        raise typer.Exit(code)


@app.command()
@guard
def demo(epochs: Annotated[int, typer.Option(help="Epochs to train.")] = 2,
         dataset: Annotated[str, typer.Option(help="Dataset URI the demo provider serves.")] = "mock://mnist",
         model: Annotated[str, typer.Option(help="mlp or cnn.")] = "cnn",
         state_dir: StateDir = None) -> None:
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
def submit(job_file: Annotated[Optional[Path], typer.Argument(help="TOML job file (flags override it).")] = None,
           dataset: Annotated[Optional[str], typer.Option(help="Dataset name (or remote://NAME).")] = None,
           model: Annotated[Optional[str], typer.Option(help="mlp, cnn, tiny-lm or module:factory.")] = None,
           epochs: Annotated[Optional[int], typer.Option()] = None,
           batch_size: Annotated[Optional[int], typer.Option()] = None,
           lr: Annotated[Optional[float], typer.Option()] = None,
           optimizer: Annotated[Optional[str], typer.Option(help="sgd or adam.")] = None,
           seed: Annotated[Optional[int], typer.Option()] = None,
           shuffle: Annotated[str | None, typer.Option(help="none, full or block.")] = None,
           block_size: Annotated[int | None, typer.Option(help="Samples per block of --shuffle block.")] = None,
           evaluate: Annotated[Optional[bool], typer.Option("--evaluate/--no-evaluate", help="Score on the provider's test split at the end.")] = None,
           world_size: Annotated[int | None, typer.Option(help="Trainers that train the job together (a gang).")] = None,
           config: Config = None, router: Router = None, secret_file: SecretFile = None, state_dir: StateDir = None,
           token: Token = None, json: Json = False) -> None:
    """Queue a training job; prints its id."""
    spec: dict = {}
    if job_file is not None:
        try:
            spec = tomllib.loads(job_file.read_text())
        except FileNotFoundError:
            fail(f"job file {job_file} does not exist", 2)
        except tomllib.TOMLDecodeError as err:
            fail(f"job file {job_file} is not valid TOML: {err}", 2)
        spec = spec.get("job", spec)
    flags = dict(dataset=dataset, model=model, epochs=epochs, batch_size=batch_size, lr=lr, optimizer=optimizer,
                 seed=seed, evaluate=evaluate, shuffle=shuffle, block_size=block_size, world_size=world_size)
    spec.update({k: v for k, v in flags.items() if v is not None})
    if "dataset" not in spec:
        fail("say which dataset to train on: --dataset NAME or a job file with dataset = \"NAME\"", 2)
    s = settings_from(config, router=router, secret_file=secret_file, state_dir=state_dir, token=token)
    with admin_client(s) as client:
        reply = client.request(SubmitJob(spec=spec))
    print_json({"job": reply.job}) if json else typer.echo(reply.job)


@app.command()
@guard
def jobs(state: Annotated[Optional[str], typer.Option(help=f"Only jobs in this state: {', '.join(JOB_STATES)}.")] = None,
         limit: Annotated[int, typer.Option(help="At most this many, newest first.")] = 50,
         config: Config = None, router: Router = None, secret_file: SecretFile = None, state_dir: StateDir = None,
         token: Token = None, json: Json = False) -> None:
    """List jobs, newest first."""
    s = settings_from(config, router=router, secret_file=secret_file, state_dir=state_dir, token=token)
    with admin_client(s) as client:
        rows = client.request(ListJobs(state=state, limit=limit)).jobs
    print_json(rows) if json else tables.jobs(rows)


@job_app.command("show")
@guard
def job_show(job: str, config: Config = None, router: Router = None, secret_file: SecretFile = None,
             state_dir: StateDir = None, token: Token = None, json: Json = False,
             progress: Annotated[int, typer.Option(help="Also the last N progress reports.")] = 0) -> None:
    """State, spec, progress, checkpoints, events and result of one job."""
    s = settings_from(config, router=router, secret_file=secret_file, state_dir=state_dir, token=token)
    with admin_client(s) as client:
        info = client.request(GetJob(job=job, progress=max(0, progress))).job
    print_json(info) if json else tables.job(info)


def _control(job: str, command: str, args: dict, config, router, secret_file, state_dir, token, json) -> None:
    """Send one ControlJob and print the acknowledgement (the trainer's, or the router's own)."""
    s = settings_from(config, router=router, secret_file=secret_file, state_dir=state_dir, token=token)
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
def job_stop(job: str, config: Config = None, router: Router = None, secret_file: SecretFile = None,
             state_dir: StateDir = None, token: Token = None, json: Json = False) -> None:
    """Stop a job; a running one checkpoints first (`busctl job resume` continues it)."""
    _control(job, "stop", {}, config, router, secret_file, state_dir, token, json)


@job_app.command("pause")
@guard
def job_pause(job: str, config: Config = None, router: Router = None, secret_file: SecretFile = None,
              state_dir: StateDir = None, token: Token = None, json: Json = False) -> None:
    """Pause a job: its trainer keeps it (and its lease) but trains on no more batches."""
    _control(job, "pause", {}, config, router, secret_file, state_dir, token, json)


@job_app.command("resume")
@guard
def job_resume(job: str, config: Config = None, router: Router = None, secret_file: SecretFile = None,
               state_dir: StateDir = None, token: Token = None, json: Json = False) -> None:
    """Resume a paused job, or queue a stopped or failed one again from its last checkpoint."""
    _control(job, "resume", {}, config, router, secret_file, state_dir, token, json)


@job_app.command("checkpoint")
@guard
def job_checkpoint(job: str, config: Config = None, router: Router = None, secret_file: SecretFile = None,
                   state_dir: StateDir = None, token: Token = None, json: Json = False) -> None:
    """Make the trainer write a checkpoint now; prints its path and sha256."""
    _control(job, "checkpoint", {}, config, router, secret_file, state_dir, token, json)


@job_app.command("set")
@guard
def job_set(job: str, values: Annotated[list[str], typer.Argument(help=f"NAME=VALUE pairs; names: {', '.join(SETTABLE)}.")],
            config: Config = None, router: Router = None, secret_file: SecretFile = None,
            state_dir: StateDir = None, token: Token = None, json: Json = False) -> None:
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
    _control(job, "set", args, config, router, secret_file, state_dir, token, json)


@job_app.command("eval")
@guard
def job_eval(job: str, config: Config = None, router: Router = None, secret_file: SecretFile = None,
             state_dir: StateDir = None, token: Token = None, json: Json = False) -> None:
    """Score a running job's current weights on its provider's private test split; training pauses
    only for the copy of the weights."""
    from .evaluate import evaluate_job
    evaluate_job(settings_from(config, router=router, secret_file=secret_file, state_dir=state_dir, token=token),
                 job, json=json)


@job_app.command("model")
@guard
def job_model(job: str, out: Annotated[Path, typer.Option("-o", "--out", help="Where to write the safetensors file.")],
              config: Config = None, router: Router = None, secret_file: SecretFile = None,
              state_dir: StateDir = None, token: Token = None) -> None:
    """Download the final weights of a succeeded job (safetensors), checked against their sha256."""
    import hashlib
    from services.atomic import write_atomic
    s = settings_from(config, router=router, secret_file=secret_file, state_dir=state_dir, token=token)
    with admin_client(s) as client:
        reply = client.request(GetModel(job=job))
    frame = reply.frames[0]
    data = bytes(frame.buffer if hasattr(frame, "buffer") else frame)
    digest = hashlib.sha256(data).hexdigest()
    if digest != reply.sha256:
        fail(f"model of {job} arrived with sha256 {digest}, expected {reply.sha256}; nothing written")
    write_atomic(out, data)
    typer.echo(f"{out}: {len(data)} bytes, sha256 {digest}")


@job_app.command("watch")
@guard
def job_watch(job: str, config: Config = None, router: Router = None, secret_file: SecretFile = None,
              state_dir: StateDir = None, token: Token = None) -> None:
    """Follow a job with a progress bar until it ends; exit 0 only if it succeeded."""
    s = settings_from(config, router=router, secret_file=secret_file, state_dir=state_dir, token=token)
    with admin_client(s) as client:
        final = watch_job(client, job)
    if final["state"] != "succeeded":
        raise typer.Exit(1)


# -- cluster -------------------------------------------------------------------------------------

@app.command()
@guard
def queues(config: Config = None, router: Router = None, secret_file: SecretFile = None, state_dir: StateDir = None,
           token: Token = None, json: Json = False) -> None:
    """Every service's queue and traffic metrics, as carried on heartbeats."""
    s = settings_from(config, router=router, secret_file=secret_file, state_dir=state_dir, token=token)
    with admin_client(s) as client:
        services = client.request(Stats()).services
    print_json(services) if json else tables.queues(services)


@app.command()
@guard
def top(interval: Annotated[float, typer.Option(min=0.1, help="Seconds between refreshes.")] = 2.0,
        once: Annotated[bool, typer.Option("--once", help="Print one frame (two snapshots --interval apart) and exit.")] = False,
        config: Config = None, router: Router = None, secret_file: SecretFile = None, state_dir: StateDir = None,
        token: Token = None, json: Annotated[bool, typer.Option("--json", help="With --once: the frame's data.")] = False) -> None:
    """A live view of providers, trainers, jobs and pipeline stages until Ctrl-C (docs/operations.md)."""
    from .top import top_command
    if json and not once:
        fail("--json prints one frame: use it with --once", 2)
    top_command(settings_from(config, router=router, secret_file=secret_file, state_dir=state_dir, token=token),
                interval=interval, once=once, json=json)


@app.command()
@guard
def control(provider: Annotated[str, typer.Argument(help="Provider name (busctl peers).")],
            stage: Annotated[str, typer.Argument(help="A stage of one of its pipeline datasets.")],
            command: Annotated[str, typer.Argument(help="stats; random stages also get, set, reset.")],
            args: Annotated[Optional[list[str]], typer.Argument(help="key=value, e.g. seed=3 epoch=2 (set).")] = None,
            dataset: Annotated[str, typer.Option(help="The pipeline dataset, when several have STAGE.")] = "",
            config: Config = None, router: Router = None, secret_file: SecretFile = None,
            state_dir: StateDir = None, token: Token = None, json: Json = False) -> None:
    """Send a control command to one stage of a provider's pipeline dataset (docs/operations.md)."""
    from .pipeline import control_command
    control_command(settings_from(config, router=router, secret_file=secret_file, state_dir=state_dir, token=token),
                    provider, stage, command, args or [], dataset=dataset, json=json)


@app.command()
@guard
def peers(config: Config = None, router: Router = None, secret_file: SecretFile = None, state_dir: StateDir = None,
          token: Token = None, json: Json = False) -> None:
    """Providers, trainers and admins connected to the router."""
    s = settings_from(config, router=router, secret_file=secret_file, state_dir=state_dir, token=token)
    with admin_client(s) as client:
        rows = client.request(ListPeers()).peers
    print_json(rows) if json else tables.peers(rows)


@app.command("datasets")
@guard
def datasets(config: Config = None, router: Router = None, secret_file: SecretFile = None,
             state_dir: StateDir = None, token: Token = None, json: Json = False) -> None:
    """Every dataset the providers serve: providers, kind, splits, sample shape and dtype, classes."""
    from .data import datasets_command
    datasets_command(settings_from(config, router=router, secret_file=secret_file, state_dir=state_dir,
                                   token=token), json=json)


@app.command("fetch")
@guard
def fetch(dataset: Annotated[str, typer.Argument(help="Dataset name (or remote://NAME).")],
          split: Annotated[str, typer.Option(help="train or val (test never leaves its provider).")] = "train",
          indices: Annotated[str, typer.Option(help="Ranges START:STOP[:STEP] such as 0:8 or 0:64:4, single indices, comma-joined: 3,7,9 or 0:4,100.")] = "0:8",
          out: Annotated[Path | None, typer.Option(help="Save instead of printing: .npz (x, y, indices) or .npy (x only).")] = None,
          epoch: Annotated[int, typer.Option(min=0, help="The epoch whose augmentations a pipeline dataset applies.")] = 0,
          config: Config = None, router: Router = None, secret_file: SecretFile = None, state_dir: StateDir = None,
          token: Token = None, json: Json = False) -> None:
    """Samples of a dataset exactly as a trainer receives them: shape, dtype, labels, per-sample summary."""
    from .data import fetch_command
    fetch_command(settings_from(config, router=router, secret_file=secret_file, state_dir=state_dir, token=token),
                  dataset, split, indices, out=out, json=json, epoch=epoch)


@token_app.command("issue")
@guard
def token_issue(role: Annotated[str, typer.Option(help=f"One of {', '.join(ROLES)}.")],
                name: Annotated[str, typer.Option(help="The token's subject.")] = "",
                ttl: Annotated[float, typer.Option(help="Lifetime in seconds.")] = 24 * 3600.0,
                dataset: Annotated[Optional[list[str]], typer.Option("--dataset", help="Restrict the token to this dataset (repeatable; default: all).")] = None,
                job: Annotated[Optional[list[str]], typer.Option("--job", help="Restrict the token to this job id (repeatable; default: all).")] = None,
                alg: Annotated[Optional[str], typer.Option("--alg", help="HS256 or EdDSA (default: token_alg setting).")] = None,
                issuer: Annotated[Optional[str], typer.Option("--issuer", help="The iss claim (default: token_issuer, else the cluster).")] = None,
                signing_key_file: Annotated[Optional[str], typer.Option("--signing-key-file", help="EdDSA signing key (or BATCHBUS_SIGNING_KEY_FILE).")] = None,
                config: Config = None, secret_file: SecretFile = None, state_dir: StateDir = None) -> None:
    """Print a signed token for ROLE: from the cluster secret (HS256) or the signing key (EdDSA)."""
    from services.runtime import mint_token, signing_key
    s = settings_from(config, secret_file=secret_file, state_dir=state_dir, token_alg=alg,
                      token_issuer=issuer, signing_key_file=signing_key_file)
    typer.echo(mint_token(s, signing_key(s), role=role, sub=name or role, ttl_s=ttl,
                          datasets=dataset or None, jobs=job or None))


@token_app.command("inspect")
@guard
def token_inspect(token: Annotated[str, typer.Argument(help="The token to show ('-' reads it from stdin).")],
                  config: Config = None, secret_file: SecretFile = None, state_dir: StateDir = None,
                  public_key_file: Annotated[Optional[str], typer.Option("--public-key-file", help="EdDSA public key (or BATCHBUS_PUBLIC_KEY_FILE).")] = None,
                  alg: Annotated[Optional[str], typer.Option("--alg", help="Verify as HS256 or EdDSA (default: token_alg setting).")] = None,
                  json: Json = False) -> None:
    """Print a token's claims: verified with this node's key where it has one, else marked UNVERIFIED."""
    import sys
    import time
    from libbus.auth import inspect_token, verify_token
    from services.runtime import verify_key
    if token == "-":
        token = sys.stdin.read().strip()
    s = settings_from(config, secret_file=secret_file, state_dir=state_dir, public_key_file=public_key_file,
                      token_alg=alg)
    header, claims = inspect_token(token)
    try:
        key = verify_key(s)
    except ConfigError as err:
        status, detail = "UNVERIFIED", f"no {s.token_alg} key here ({err})"
    else:
        try:
            verify_token(token, key, audience=s.cluster, issuer=s.token_issuer, algorithm=s.token_alg)
            status, detail = "VERIFIED", f"{s.token_alg} signature, audience, issuer and lifetime check out"
        except BusError as err:
            status, detail = "INVALID", f"{err} [{err.code}]"
    if json:
        print_json({"status": status, "detail": detail, "header": header, "claims": claims})
    else:
        typer.echo(f"{status}: {detail}")
        typer.echo(f"  alg: {header.get('alg')}")
        for key_name, value in claims.items():
            if key_name in ("iat", "nbf", "exp") and isinstance(value, (int, float)):
                value = f"{value} ({time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(value))})"
            typer.echo(f"  {key_name}: {value}")
    if status == "INVALID":
        raise typer.Exit(1)


@token_app.command("revoke")
@guard
def token_revoke(what: Annotated[str, typer.Argument(help="The token to revoke ('-' reads it from stdin), or its bare jti.")],
                 reason: Annotated[str, typer.Option(help="Why: kept with the revocation.")] = "",
                 keep: Annotated[Optional[float], typer.Option("--keep", help="For a bare jti: seconds to keep refusing it (default: token_ttl_s). A whole token is refused until it expires.")] = None,
                 config: Config = None, router: Router = None, secret_file: SecretFile = None,
                 state_dir: StateDir = None, token: Token = None) -> None:
    """Revoke a token on every service: the router stores it (a restart keeps it), refuses it, closes
    its sessions and tells every provider, which does the same."""
    import sys
    import time
    from libbus.auth import inspect_token
    from libbus.messages import RevokeToken
    if what == "-":
        what = sys.stdin.read().strip()
    s = settings_from(config, router=router, secret_file=secret_file, state_dir=state_dir, token=token)
    if what.count(".") == 2:  # a JWT: take its id and expiry from it
        _, claims = inspect_token(what)
        jti, exp = claims.get("jti"), claims.get("exp")
        if not isinstance(jti, str) or not isinstance(exp, (int, float)):
            fail("that token has no jti or exp claim: nothing to revoke", 2)
    else:
        jti, exp = what, time.time() + (s.token_ttl_s if keep is None else keep)
    with admin_client(s) as client:
        client.request(RevokeToken(jti=jti, exp=float(exp), reason=reason))
    typer.echo(f"revoked {jti} until {time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(exp))}")


@token_app.command("revoked")
@guard
def token_revoked(config: Config = None, router: Router = None, secret_file: SecretFile = None,
                  state_dir: StateDir = None, token: Token = None, json: Json = False) -> None:
    """Tokens revoked and not yet expired, newest first."""
    from libbus.messages import ListRevoked
    s = settings_from(config, router=router, secret_file=secret_file, state_dir=state_dir, token=token)
    with admin_client(s) as client:
        rows = client.request(ListRevoked()).revoked
    print_json(rows) if json else tables.revoked(rows)


@keys_app.command("gen")
@guard
def keys_gen(name: Annotated[str, typer.Argument(help="The key's name: the service (or admin) that uses it; tokens for it carry this subject.")],
             out: Annotated[Path, typer.Option("--dir", help="Where to write NAME.key and NAME.key_secret.")] = Path(".")) -> None:
    """Create a CURVE key pair: NAME.key_secret (0600, stays on its node; curve_key_file) and
    NAME.key (public: copy it into the authorized directory of every server it connects to;
    the router's goes to every node as curve_router_key)."""
    from libbus.curve import generate_keys
    public, secret_path = generate_keys(out, name)
    typer.echo(f"public key {public} (copy to the servers' curve_authorized_dir)\n"
               f"secret key {secret_path} (0600, keep it on this node)")


@token_app.command("keygen")
@guard
def token_keygen(path: Annotated[Path, typer.Argument(help="Where to write the Ed25519 signing key (mode 0600); the public key goes to PATH.pub.")]) -> None:
    """Create an EdDSA signing key (keep it on the administrator's machine) and its public key
    (copy PATH.pub to every node as public_key_file; set token_alg = "EdDSA")."""
    from libbus.auth import generate_signing_key
    key, pub = generate_signing_key(path)
    typer.echo(f"signing key {key} (0600, keep it private)\npublic key {pub} (copy to every node)")


@token_app.command("secret")
@guard
def token_secret(path: Annotated[Path, typer.Argument(help="Where to create the secret (mode 0600).")]) -> None:
    """Create a cluster secret file if it does not exist yet; copy it to every node."""
    existed = path.exists()
    ensure_secret(path)
    typer.echo(f"{path} {'already exists' if existed else 'created'}")


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
        typer.echo(f"removed {len(rows)} ring(s), {total / 2**20:.1f} MiB"
                   + "".join(f"\n  {r['name']} (pid {r['pid']})" for r in rows))


@config_app.command("show")
@guard
def config_show(config: Config = None, json: Json = False) -> None:
    """Every setting, its effective value and where that value came from."""
    settings, sources = load_settings(config_file=config)
    values = settings.as_dict()
    if json:
        print_json({k: {"value": v, "source": sources[k]} for k, v in values.items()})
    else:
        tables.settings(values, sources)


def main() -> None:
    app()
