"""What the busctl commands share: settings from options, the admin connection, output, errors."""

from __future__ import annotations

import functools
import getpass
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import orjson
import typer

from libbus.config import Settings, load_settings
from libbus.connect.client import Client, Identity
from libbus.errors import BusError, ConfigError

__all__ = ["settings_from", "admin_client", "fail", "guard", "print_json", "setup_logging"]


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


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
    from services import runtime  # noqa: PLC0415 - keeps busctl start-up light

    curve = runtime.curve_keys(settings, "admin")
    name = settings.name or (curve.name if curve else f"busctl-{getpass.getuser()}-{os.getpid()}")
    if settings.token:
        token: Any = settings.token
    else:  # short-lived, minted afresh whenever the client says Hello (`busctl job watch` runs for hours)
        key = runtime.signing_key(settings)
        token = lambda: runtime.mint_token(settings, key, role="admin", sub=name, ttl_s=600)  # noqa: E731
    identity = Identity(
        role="admin",
        name=name,
        token=token,
        curve=curve,
        router_key=runtime.router_key(settings),
        handshake=settings.handshake_auth,
    )
    return Client(
        settings.router,
        identity,
        timeout_s=settings.request_timeout_s,
        retries=settings.request_retries,
        server_key=identity.router_key,
    )


def fail(message: str, code: int = 1) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def guard(fn: Callable) -> Callable:
    """Turn batchbus errors into one line on stderr and a non-zero exit, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConfigError as err:
            fail(str(err), 2)
        except BusError as err:
            fail(f"{err} [{err.code}]" if err.code not in ("INTERNAL",) else str(err))
        except KeyboardInterrupt:
            fail("interrupted", 130)
        except OSError as err:
            fail(f"{err.strerror or err}: {err.filename}" if err.filename else str(err))
        except typer.Exit:
            raise
        except Exception as err:  # noqa: BLE001 - a bug: one line here, the traceback in the debug log
            logging.getLogger("busctl").debug("unexpected error", exc_info=True)
            fail(f"unexpected {type(err).__name__}: {err} (a bug: please report it)")

    return wrapper


def print_json(value: Any) -> None:
    typer.echo(orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode())
