"""``busctl start router|provider|trainer``: run a service in the foreground (systemd-friendly)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from .connection import settings_from
from .options import Bind, Config, LogLevel, MetricsBind, Name, ReadyFile, Router, SecretFile, StateDir, Token
from .output import fail, guard, setup_logging

__all__ = ["start_app"]

start_app = typer.Typer(no_args_is_help=True, help="Run a service in the foreground (systemd-friendly).")


def _write_ready(path: Path | None, endpoint: str) -> None:
    if path is not None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(endpoint + "\n")
        tmp.replace(path)


def _serve(service, ready_file: Path | None, ready: Callable[[str], str]) -> None:
    """Run a router or provider in the foreground until SIGTERM/SIGINT: bind, freeze what start-up built
    out of the garbage collector's walks (``gc_freeze``), write the ready file, tell systemd (``ready(endpoint)`` is its
    status line), feed its watchdog from the loop."""
    import threading

    from services import process

    stop, notify = threading.Event(), process.notifier()
    process.install_signal_handlers(stop, notify)
    endpoint = service.start()
    if service.settings.gc_freeze:
        process.freeze_startup_heap()
    _write_ready(ready_file, endpoint)
    notify.ready(ready(endpoint))
    try:
        service.run(stop, notify.watchdog)
    finally:
        process.finish(notify)


def _modules(values: list[str] | None) -> str | None:
    """Repeated ``--job-modules A --job-modules B,C`` as the setting's comma-separated form."""
    return ",".join(values) if values else None


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
    _serve(RouterService(s), ready_file, lambda endpoint: f"routing on {endpoint}; jobs in {s.db}")


@start_app.command("provider")
@guard
def start_provider(
    dataset: Annotated[
        list[str] | None,
        typer.Option(
            "--dataset",
            help="NAME=URI, repeatable: mnist=mock://mnist, 'zeros=dummy://?shape=1,28,28&n=1000' (quote a URI "
            "holding ? or &). On any URI, private_test=false makes the test split readable by trainers "
            "(default: it never leaves the provider).",
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
    cache_dir: Annotated[
        str | None,
        typer.Option(help="Disk cache of object-store datasets, shared by providers (or BATCHBUS_CACHE_DIR)."),
    ] = None,
    cache_limit: Annotated[
        str | None,
        typer.Option(help="Most bytes the cache holds, least recently used evicted (or BATCHBUS_CACHE_LIMIT)."),
    ] = None,
    evaluator_modules: Annotated[
        list[str] | None,
        typer.Option(
            "--evaluator-modules",
            metavar="MODULE[,MODULE]",
            help="Modules whose evaluators may score models on the test split: exact names, or a package as "
            "'mylab.' (repeatable or comma-separated; evaluator_modules, BATCHBUS_EVALUATOR_MODULES). "
            "Default: built-in models only.",
        ),
    ] = None,
    eval_epsilon: Annotated[
        float | None,
        typer.Option(
            help="Privacy noise of released test scores (docs/security.md §9; default 0.1). 0: exact scores, "
            "only where every asker may see the test split."
        ),
    ] = None,
) -> None:
    """Serve datasets on a data socket and register them with the router."""
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
        cache_dir=cache_dir,
        cache_limit=cache_limit,
        evaluator_modules=_modules(evaluator_modules),
        eval_epsilon=eval_epsilon,
    )
    setup_logging(s.log_level)
    service = ProviderService(s)
    _serve(service, ready_file, lambda endpoint: f"serving {', '.join(service.handler.datasets)} on {endpoint}")
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
    torch_threads: Annotated[
        int | None, typer.Option(help="torch intra-op threads of each job's attempt (0: torch's default).")
    ] = None,
    heartbeat_ms: Annotated[int | None, typer.Option(help="Heartbeat interval.")] = None,
    metrics_bind: MetricsBind = None,
    job_modules: Annotated[
        list[str] | None,
        typer.Option(
            "--job-modules",
            metavar="MODULE[,MODULE]",
            help="Modules whose code jobs may run here (entrypoints, module:factory models): exact names, or a "
            "package as 'mylab.' (repeatable or comma-separated; job_modules, BATCHBUS_JOB_MODULES). "
            "Default: built-in models only.",
        ),
    ] = None,
    attempt_user: Annotated[
        str | None,
        typer.Option(
            help="A trainer run as root: the user its jobs' attempts run as, out of reach of its token file, "
            "other jobs' checkpoints and co-located services' files (attempt_user, BATCHBUS_ATTEMPT_USER; "
            "docs/security.md §4.1). Default: the trainer's own user.",
        ),
    ] = None,
) -> None:
    """Take jobs from the router and train them on batches pulled from providers."""
    from services.trainer.service.app import run_trainer

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
        job_modules=_modules(job_modules),
        attempt_user=attempt_user,
    )
    setup_logging(s.log_level)
    code = run_trainer(s)
    if code:
        raise typer.Exit(code)
