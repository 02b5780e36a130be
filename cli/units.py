"""``busctl install-units``: put the systemd units, the service user's and the directories' snippets
in place, and say what to run next (systemd/README.md explains every step)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from libbus.errors import ConfigError

from .output import fail

__all__ = ["UNITS", "VENV", "install_units", "units_source"]

#: The unit files, and the virtual environment they run ``busctl`` from as shipped.
UNITS = ("batchbus-router.service", "batchbus-provider@.service", "batchbus-trainer@.service")
VENV = "/opt/batchbus/.venv"
#: Snippet in systemd/ → where it goes (under ``--root``).
SNIPPETS = {"batchbus.sysusers": "etc/sysusers.d/batchbus.conf", "batchbus.tmpfiles": "etc/tmpfiles.d/batchbus.conf"}
#: ProtectHome=yes hides these from the services.
HIDDEN = ("/home", "/root", "/run/user")


def units_source() -> Path:
    """systemd/ of this checkout, or the copy a wheel installs under ``<prefix>/share/batchbus``."""
    for candidate in (
        Path(__file__).resolve().parents[1] / "systemd",
        Path(sys.prefix) / "share" / "batchbus" / "systemd",
    ):
        if all((candidate / name).is_file() for name in (*UNITS, *SNIPPETS)):
            return candidate
    raise ConfigError(
        "the batchbus unit files are not installed with this busctl (looked in the "
        f"checkout's systemd/ and {sys.prefix}/share/batchbus/systemd)"
    )


def _check_prefix(prefix: str) -> None:
    """Refuse a prefix that cannot work in ``ExecStart=`` or that the sandbox hides."""
    if not prefix.startswith("/") or any(c.isspace() or c in "%$\\\"'" for c in prefix):
        raise ConfigError(
            f"--prefix {prefix!r}: give the virtual environment as an absolute path without spaces, "
            "quotes, '%' or '$' (it goes into ExecStart=)"
        )
    if any(prefix == d or prefix.startswith(d + "/") for d in HIDDEN):
        raise ConfigError(
            f"--prefix {prefix}: the units run with ProtectHome=yes, which hides {', '.join(HIDDEN)}; "
            f"install batchbus elsewhere (e.g. {VENV})"
        )


def _write(path: Path, text: str) -> str:
    """Write ``text`` to ``path`` (0644). Returns "installed", "updated" or "unchanged"."""
    old = path.read_text() if path.exists() else None
    if old == text:
        return "unchanged"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.chmod(0o644)
    tmp.replace(path)
    return "installed" if old is None else "updated"


UnitsDir = Annotated[
    Path | None, typer.Option("--dir", help="Where the unit files go (default ROOT/etc/systemd/system).")
]
Prefix = Annotated[str, typer.Option("--prefix", help="The virtual environment the units run busctl from.")]
Root = Annotated[Path, typer.Option("--root", help="Install under this root directory (an image, a test).")]


def install_units(dir: UnitsDir = None, prefix: Prefix = VENV, root: Root = Path("/")) -> None:
    """Install the systemd units (router, provider@, trainer@) and the sysusers.d/tmpfiles.d
    snippets for their static user and directories, then print the commands that enable them."""
    prefix = prefix.rstrip("/") or "/"
    _check_prefix(prefix)
    source = units_source()
    units_dir = dir if dir is not None else root / "etc/systemd/system"
    targets = {units_dir / name: (source / name).read_text().replace(VENV + "/", prefix + "/") for name in UNITS}
    targets.update({root / dest: (source / name).read_text() for name, dest in SNIPPETS.items()})
    done = []
    for path, text in targets.items():
        try:
            done.append((_write(path, text), path))
        except OSError as err:
            fail(f"cannot write {path}: {err.strerror} (run as root, or choose another --root/--dir)")
    for what, path in done:
        typer.echo(f"{what:>9}  {path}")
    busctl = f"{prefix}/bin/busctl"
    if not Path(busctl).exists():
        typer.echo(
            f"note: {busctl} does not exist yet: install batchbus into {prefix} (systemd/README.md), or pass --prefix",
            err=True,
        )
    typer.echo(f"""
Next, as root (systemd/README.md explains each step):
  systemd-sysusers {root / SNIPPETS["batchbus.sysusers"]}
  systemd-tmpfiles --create {root / SNIPPETS["batchbus.tmpfiles"]}
  # once per cluster; copy the same file (root, 0600) to /etc/credstore/ on every node:
  {busctl} token secret /etc/credstore/batchbus.secret
  # settings: /etc/batchbus/batchbus.toml, provider-NAME.toml, trainer-NAME.toml
  systemctl daemon-reload && systemctl enable --now batchbus-router.service \\
      batchbus-provider@NAME.service batchbus-trainer@NAME.service""")
