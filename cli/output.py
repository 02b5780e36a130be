"""What busctl prints: peer-made text made safe for a terminal, JSON, and errors as one line (never a
traceback). (Settings from options and the admin connection: :mod:`cli.connection`.)"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import orjson
import typer
from rich.console import Console
from rich.errors import MarkupError
from rich.text import Text

from libbus.errors import BusError, ConfigError

__all__ = ["SafeConsole", "echo", "fail", "guard", "print_json", "printable", "setup_logging"]


# -- output: what peers wrote reaches the terminal as text, never as commands ----------------------
#
# Job names, errors, events, peer names, dataset and stage names come from peers (a trainer, a
# provider, another admin's spec). A terminal acts on the control characters in them (``\x1b[2J``
# clears the screen, OSC 52 writes the clipboard, ``\r`` overwrites a line, bidi overrides reorder
# it), so every line busctl prints goes through :func:`printable`: by :class:`SafeConsole` for rich
# output (tables, ``job show``, ``watch``, ``top``) and by :func:`echo` / :func:`fail` for plain lines.
# JSON output needs nothing: orjson writes control characters as ``\u001b``.


def printable(text: str, keep: str = "\n\t") -> str:
    """``text`` with every character that is not printable (``str.isprintable``: control, format
    such as bidi overrides, separators other than the space) written as its Python escape
    (``\x1b``, ``\u202e``), except those in ``keep`` (the line breaks and tabs busctl itself prints)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


class SafeConsole(Console):
    """A rich console whose every string (printed, in a table cell or title) is made
    :func:`printable` before rich reads it; a peer string whose brackets rich cannot parse as markup
    is printed as it is rather than failing the command."""

    def render_str(self, text: str, **kw: Any) -> Text:
        text = printable(text)
        try:
            return super().render_str(text, **kw)
        except MarkupError:
            return super().render_str(text, **{**kw, "markup": False})


def echo(message: str, err: bool = False) -> None:
    """``typer.echo`` of :func:`printable` text."""
    typer.echo(printable(message), err=err)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def fail(message: str, code: int = 1) -> NoReturn:
    echo(f"error: {message}", err=True)  # an error's text may quote a peer (a job name, a trainer's error)
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
        except BrokenPipeError:
            _reader_left()
        except OSError as err:
            fail(f"{err.strerror or err}: {err.filename}" if err.filename else str(err))
        except typer.Exit:
            raise
        except Exception as err:  # noqa: BLE001 - a bug: one line here, the traceback in the debug log
            logging.getLogger("busctl").debug("unexpected error", exc_info=True)
            fail(f"unexpected {type(err).__name__}: {err} (a bug: please report it)")

    return wrapper


def _reader_left() -> NoReturn:
    """The reader of stdout left early (``busctl job logs --json | head``): it read what it wanted, so
    nothing is said. stdout is pointed at /dev/null (the recipe of Python's signal docs) so the flush at
    exit has nowhere to fail, and the status is a shell's own for a pipe closed under it (128 + SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    raise typer.Exit(141)


def print_json(value: Any) -> None:
    """``value`` as indented JSON. orjson escapes control characters but writes the rest of Unicode
    as it is; what a terminal would act on (bidi overrides, other format characters) is written as
    a JSON escape here, so the text decodes to the same value."""
    text = orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()
    if not text.isprintable():
        text = "".join(c if c.isprintable() or c in "\n" else _json_escape(c) for c in text)
    typer.echo(text)


def _json_escape(c: str) -> str:
    cp = ord(c)
    if cp < 0x10000:
        return f"\\u{cp:04x}"
    cp -= 0x10000  # beyond the BMP: a surrogate pair, as JSON writes it
    return f"\\u{0xD800 + (cp >> 10):04x}\\u{0xDC00 + (cp & 0x3FF):04x}"
