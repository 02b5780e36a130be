"""``busctl web``: serve the read-only web view of jobs, studies and services (services/web, docs/web.md)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

from .connection import settings_from
from .options import Config, LogLevel, ReadyFile, Router, StateDir
from .output import echo, fail, guard, setup_logging

__all__ = ["web"]


@guard
def web(
    bind: Annotated[
        str,
        typer.Option("--bind", help="HOST:PORT to serve on (port 0: any free one); loopback unless --allow-remote."),
    ] = "127.0.0.1:8765",
    allow_remote: Annotated[
        bool,
        typer.Option(
            "--allow-remote",
            help="Serve on an address other machines reach: tokens and cookies then cross the network in clear, "
            "unless a TLS proxy stands in front (docs/web.md).",
        ),
    ] = False,
    config: Config = None,
    router: Router = None,
    state_dir: StateDir = None,
    log_level: LogLevel = None,
    ready_file: ReadyFile = None,
) -> None:
    """A read-only web view of jobs (curves, stalls, events, logs), studies and services, until Ctrl-C.

    Open the URL it prints and sign in with your token: the page shows what it grants, as busctl does (docs/web.md)."""
    from services.atomic import write_atomic  # noqa: PLC0415 - keeps busctl start-up light
    from services.web import WebServer, is_loopback, parse_bind  # noqa: PLC0415

    settings = settings_from(config, router=router, state_dir=state_dir, log_level=log_level)
    setup_logging(settings.log_level)
    host, port = parse_bind(bind)
    if not is_loopback(host) and not allow_remote:
        fail(
            f"--bind {bind}: not a loopback address; the sign-in token and the session cookie would cross the "
            "network in clear. Serve on 127.0.0.1 (and reach it through an SSH tunnel), or add --allow-remote "
            "behind a TLS proxy (docs/web.md)",
            2,
        )
    server = WebServer(settings, host, port)
    try:
        url = server.start()
    except OSError as err:
        fail(f"cannot serve on {bind}: {err.strerror or err}", 1)
    signal.signal(signal.SIGTERM, _interrupt)  # systemd's stop: as Ctrl-C, sessions closed, exit 0
    echo(f"busctl web: {url} (router {settings.router}; Ctrl-C to stop)")
    if ready_file is not None:
        write_atomic(Path(ready_file), url.encode())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
