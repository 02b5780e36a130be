"""Options many busctl commands share, declared once (typer ``Annotated`` types)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

__all__ = ["Config", "Router", "SecretFile", "StateDir", "Token", "Bind", "Name", "LogLevel", "ReadyFile", "Json",
           "MetricsBind"]

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
