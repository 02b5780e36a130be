"""``-h`` is help on every busctl command and subcommand. The test walks the whole command tree the app builds, so a command added
later is covered without a line here."""

from __future__ import annotations

import typer

from cli.app import app
from tests.support import busctl, busctl_in_process


def command_paths() -> list[tuple[str, ...]]:
    """Every command and group of the app, as the words a user types after ``busctl``."""
    paths: list[tuple[str, ...]] = []

    def walk(cmd, path: tuple[str, ...]) -> None:
        paths.append(path)
        for name, sub in getattr(cmd, "commands", {}).items():  # a group (typer's click may be vendored)
            walk(sub, (*path, name))

    walk(typer.main.get_command(app), ())
    return paths


def test_every_command_and_subcommand_takes_dash_h():
    paths = command_paths()
    # the walk sees the tree: groups and their leaves
    assert {("start", "provider"), ("job", "show"), ("token", "issue"), ("datasets",), ("bench",)} <= set(paths)
    for path in paths:
        code, out, err = busctl_in_process(*path, "-h")
        assert code == 0, f"busctl {' '.join(path)} -h exited {code}: {out}{err}"
        assert "usage:" in out.lower(), f"busctl {' '.join(path)} -h printed no usage: {out}{err}"
        words = " ".join(("busctl", *path))
        if path != ("bench",):  # bench -h is the benchmark's own parser (its options); --help is click's
            assert words in " ".join(out.split()), f"{words} -h printed another command's help: {out}"
            assert busctl_in_process(*path, "--help")[1] == out, f"{words}: -h and --help differ"


def test_dash_h_from_the_installed_console_script():
    out = busctl("start", "provider", "-h", check=True)
    assert "busctl start provider" in " ".join(out.stdout.split()) and "--dataset" in out.stdout
