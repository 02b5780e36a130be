"""How a busctl command reaches the cluster: its settings from the options, and the admin connection
to the router. (What it prints: :mod:`cli.output`.)"""

from __future__ import annotations

import getpass
import os
from typing import Any

import typer

from libbus.config import Settings, load_settings
from libbus.connect.client import Client, Identity

__all__ = ["admin_client", "settings_from"]


def settings_from(config: str | None = None, **flags: Any) -> Settings:
    if flags.get("token"):
        typer.echo(
            "warning: a token given with --token shows in 'ps' and shell history; put it in a file "
            "named by BATCHBUS_TOKEN_FILE (or token_file in the config), or in BATCHBUS_TOKEN",
            err=True,
        )
    settings, _ = load_settings(config_file=config, flags=flags)
    return settings


def admin_client(settings: Settings) -> Client:
    """A connection to the router as admin: ``settings.token`` if set, else minted from the secret
    (HS256) or the signing key (EdDSA)."""
    from services import credentials  # noqa: PLC0415 - keeps busctl start-up light

    curve = credentials.curve_keys(settings, "admin")
    name = settings.name or (curve.name if curve else f"busctl-{getpass.getuser()}-{os.getpid()}")
    if settings.token:
        token: Any = settings.token
    else:  # short-lived, minted afresh whenever the client says Hello (`busctl job watch` runs for hours)
        key = credentials.signing_key(settings)
        token = lambda: credentials.mint_token(settings, key, role="admin", sub=name, ttl_s=600)  # noqa: E731
    identity = Identity(
        role="admin",
        name=name,
        token=token,
        curve=curve,
        router_key=credentials.router_key(settings),
        handshake=settings.handshake_auth,
    )
    return Client(
        settings.router,
        identity,
        timeout_s=settings.request_timeout_s,
        retries=settings.request_retries,
        server_key=identity.router_key,
    )
