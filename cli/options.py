"""Options many busctl commands share, declared once (typer ``Annotated`` types), and
:func:`admin_options`, which gives a command the five that every command talking to the router takes."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from .connection import settings_from

__all__ = [
    "Config",
    "Router",
    "SecretFile",
    "StateDir",
    "Token",
    "Bind",
    "Name",
    "LogLevel",
    "ReadyFile",
    "Json",
    "MetricsBind",
    "ADMIN_OPTIONS",
    "admin_options",
]

Config = Annotated[str | None, typer.Option("--config", help="TOML settings file (or BATCHBUS_CONFIG).")]
Router = Annotated[str | None, typer.Option("--router", help="Router address (or BATCHBUS_ROUTER).")]
SecretFile = Annotated[str | None, typer.Option("--secret-file", help="Cluster secret (or BATCHBUS_SECRET_FILE).")]
StateDir = Annotated[str | None, typer.Option("--state-dir", help="State directory (or BATCHBUS_STATE_DIR).")]
Token = Annotated[str | None, typer.Option("--token", help="Use this token (or BATCHBUS_TOKEN).")]
Bind = Annotated[str | None, typer.Option("--bind", help="Address to bind, e.g. tcp://0.0.0.0:5555.")]
Name = Annotated[str | None, typer.Option("--name", help="Service name (default role-host-pid).")]
LogLevel = Annotated[str | None, typer.Option("--log-level", help="DEBUG, INFO, WARNING, ERROR.")]
ReadyFile = Annotated[Path | None, typer.Option("--ready-file", help="Write the bound endpoint here once serving.")]
Json = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
MetricsBind = Annotated[
    str | None, typer.Option("--metrics-bind", help="Serve Prometheus /metrics on HOST:PORT (docs/operations.md).")
]

#: What every command that talks to the router as admin takes, in --help order.
ADMIN_OPTIONS = {"config": Config, "router": Router, "secret_file": SecretFile, "state_dir": StateDir, "token": Token}


def admin_options(command: Callable) -> Callable:
    """Give ``command`` the options of :data:`ADMIN_OPTIONS` (``--config --router --secret-file
    --state-dir --token``) in place of its keyword-only ``settings`` parameter, which it receives built
    from them (settings file, environment, flags). Apply it below ``@guard``, so that a bad setting is a
    one-line error like any other."""
    signature = inspect.signature(command, eval_str=True)
    params: list[inspect.Parameter] = []
    for param in signature.parameters.values():
        if param.name == "settings":
            params += [
                inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=kind)
                for name, kind in ADMIN_OPTIONS.items()
            ]
        else:
            params.append(param)

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        given = {name: kwargs.pop(name, None) for name in ADMIN_OPTIONS}
        return command(*args, settings=settings_from(given.pop("config"), **given), **kwargs)

    wrapper.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]  # typer reads it
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper
