"""The systemd units in systemd/: start the right busctl command with options that exist, keep the
hardening they promise, and pass ``systemd-analyze verify`` (where systemd is installed)."""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from libbus.config import load_settings
from libbus.errors import ConfigError
from tests.support import REPO, busctl

UNITS_DIR = REPO / "systemd"
UNITS = {
    "router": "batchbus-router.service",
    "provider": "batchbus-provider@.service",
    "trainer": "batchbus-trainer@.service",
}
BUSCTL = "/opt/batchbus/.venv/bin/busctl"

# key -> required value, in every unit.
HARDENING = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectControlGroups": "yes",
    "LockPersonality": "yes",
    "SystemCallArchitectures": "native",
}
TRUE = {"yes", "true", "on", "1"}


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """Section -> key -> every value assigned, in order (systemd keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path.name}: {line!r} outside a section"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def service(role: str) -> dict[str, list[str]]:
    return parse_unit(UNITS_DIR / UNITS[role])["Service"]


def one(svc: dict[str, list[str]], key: str) -> str:
    values = svc.get(key)
    assert values, f"{key}= is missing"
    return values[-1]


def environment(svc: dict[str, list[str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in svc.get("Environment", []):
        for assignment in shlex.split(line):
            name, _, value = assignment.partition("=")
            env[name] = value
    return env


def exec_start(role: str) -> list[str]:
    values = service(role).get("ExecStart", [])
    assert len(values) == 1, f"{UNITS[role]}: expected one ExecStart=, got {values}"
    return shlex.split(values[0])


@functools.cache
def start_help(role: str) -> str:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    env.pop("FORCE_COLOR", None)
    proc = subprocess.run(
        [sys.executable, "-m", "cli", "start", role, "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("role", UNITS)
def test_exec_start_runs_the_venv_busctl(role):
    argv = exec_start(role)
    assert os.path.isabs(argv[0]) and argv[0] == BUSCTL, argv
    assert " ".join(argv[:3]).endswith(f"/busctl start {role}"), argv
    if role == "router":
        assert environment(service(role))["BATCHBUS_CONFIG"] == "/etc/batchbus/batchbus.toml"
    else:
        i = argv.index("--config")
        assert argv[i + 1] == f"/etc/batchbus/{role}-%i.toml"


@pytest.mark.parametrize("role", UNITS)
def test_exec_start_options_exist(role):
    text = start_help(role)
    options = [arg.split("=", 1)[0] for arg in exec_start(role)[3:] if arg.startswith("--")]
    for option in options:
        assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text), (
            f"{UNITS[role]}: {option} is not an option of 'busctl start {role}':\n{text}"
        )


@pytest.mark.parametrize("role", UNITS)
def test_service_basics(role):
    svc = service(role)
    assert one(svc, "Type") == "notify"
    assert one(svc, "NotifyAccess") == "main"
    # The watchdog is on, and longer than the trainer's longest ordinary wait (a batch's retries).
    assert float(one(svc, "WatchdogSec")) >= (120 if role == "trainer" else 30)
    assert one(svc, "Restart") == "on-failure"
    assert one(svc, "TimeoutStopSec") == "30"
    env = environment(svc)
    assert env["BATCHBUS_STATE_DIR"].startswith("/var/lib/batchbus/")
    assert env["BATCHBUS_SECRET_FILE"] == "/var/lib/batchbus/secret"
    state_dirs = " ".join(svc.get("StateDirectory", [])).split()
    assert "batchbus" in state_dirs
    assert env["BATCHBUS_STATE_DIR"].removeprefix("/var/lib/") in state_dirs
    # Exactly one of a static user or a dynamic one.
    dynamic = svc.get("DynamicUser", ["no"])[-1] in TRUE
    assert dynamic != bool(svc.get("User")), "choose DynamicUser= or User="
    assert parse_unit(UNITS_DIR / UNITS[role])["Install"]["WantedBy"] == ["multi-user.target"]


@pytest.mark.parametrize("role", UNITS)
def test_hardening(role):
    svc = service(role)
    for key, value in HARDENING.items():
        assert one(svc, key) == value, f"{UNITS[role]}: {key}"
    assert one(svc, "RestrictAddressFamilies").split() == ["AF_UNIX", "AF_INET", "AF_INET6"]
    assert "MemoryDenyWriteExecute" not in svc, "torch's JIT needs W+X memory"
    # Shared-memory rings in /dev/shm must survive and be shared.
    assert svc.get("PrivateIPC", ["no"])[-1] not in TRUE
    assert svc.get("RemoveIPC", ["no"])[-1] not in TRUE
    if role == "trainer":
        assert one(svc, "PrivateDevices") == "no", "the trainer needs /dev/nvidia*"
        # A closed device policy (ProtectClock= implies one) must list the GPUs.
        assert one(svc, "DevicePolicy") == "closed"
        allowed = svc["DeviceAllow"]
        assert {"char-nvidia* rw", "char-drm rw", "char-kfd rw"} <= set(allowed), allowed
    else:
        assert one(svc, "PrivateDevices") == "yes"


def test_secret_is_shared():
    users = {role: (one(service(role), "User"), environment(service(role))["BATCHBUS_SECRET_FILE"]) for role in UNITS}
    assert len(set(users.values())) == 1, users
    # ... and so is the credential that takes its place when provisioned in /etc/credstore.
    for role in UNITS:
        creds = service(role)["LoadCredential"]
        assert "secret:batchbus.secret" in creds
        assert "token.pub:batchbus.token.pub" in creds  # the default set-up: nodes verify with the public key
        assert any(
            c.endswith(".key_secret") and c.split(":")[0].removesuffix(".key_secret") in ("router", f"{role}-%i")
            for c in creds
        ), creds


@pytest.mark.parametrize("role", UNITS)
def test_systemd_analyze_verify(role):
    lines = verify(UNITS_DIR / UNITS[role], cwd=UNITS_DIR)
    # On a machine without the venv the only complaint allowed is the missing ExecStart binary.
    missing = f"Command {BUSCTL} is not executable: No such file or directory"
    other = [line for line in lines if not line.endswith(missing)]
    assert not other, "\n".join(lines)


def verify(*units: Path, cwd: Path) -> list[str]:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not on PATH (install systemd to verify the units)")
    proc = subprocess.run(
        [tool, "verify", *map(str, units)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SYSTEMD_LOG_COLOR": "0"},
    )
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]


def test_install_units_puts_verified_units_in_place(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "busctl").write_text("#!/bin/sh\n")
    (venv / "bin" / "busctl").chmod(0o755)
    out = busctl("install-units", "--root", str(tmp_path / "root"), "--prefix", str(venv))
    assert out.returncode == 0, out.stderr
    units = tmp_path / "root/etc/systemd/system"
    installed = sorted(p.name for p in units.iterdir())
    assert installed == sorted(UNITS.values())
    assert (tmp_path / "root/etc/sysusers.d/batchbus.conf").read_text().count("u batchbus") == 1
    assert "/etc/credstore" in (tmp_path / "root/etc/tmpfiles.d/batchbus.conf").read_text()
    assert "systemctl daemon-reload && systemctl enable --now batchbus-router.service" in out.stdout
    for name in UNITS.values():
        text = (units / name).read_text()
        assert f"ExecStart={venv}/bin/busctl start" in text and "/opt/batchbus/.venv" not in text
    # With the venv's busctl in place, systemd has nothing at all to say about them.
    assert verify(*(units / name for name in UNITS.values()), cwd=units) == []
    again = busctl("install-units", "--root", str(tmp_path / "root"), "--prefix", str(venv))
    assert again.returncode == 0 and again.stdout.count("unchanged") == 5


@pytest.mark.parametrize(
    "args, message",
    [
        (["--root", "/etc/hostname/below-a-file"], "cannot write /etc/hostname/below-a-file/etc/systemd"),
        (["--prefix", "/home/me/venv", "--root", "/tmp/never-written"], "ProtectHome=yes"),
        (["--prefix", "relative/venv", "--root", "/tmp/never-written"], "absolute path"),
    ],
)
def test_install_units_refuses_clearly(args, message):
    out = busctl("install-units", *args)
    assert out.returncode != 0 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr + out.stdout


def readme_toml_blocks() -> list[str]:
    text = (UNITS_DIR / "README.md").read_text()
    return re.findall(r"```toml\n(.*?)```", text, flags=re.S)


def test_readme_examples_are_valid_settings(tmp_path):
    blocks = readme_toml_blocks()
    assert len(blocks) >= 3
    for n, block in enumerate(blocks):
        path = tmp_path / f"example{n}.toml"
        path.write_text(block)
        settings, sources = load_settings(config_file=str(path), env={"BATCHBUS_STATE_DIR": str(tmp_path)})
        assert any(src.startswith("file ") for src in sources.values())
    assert any("datasets" in block for block in blocks)


def test_systemd_credentials_provide_secret_token_and_curve_key(tmp_path):
    creds = tmp_path / "credentials"
    creds.mkdir()
    (creds / "secret").write_text("s" * 64)
    (creds / "token").write_text("eyJ.token\n")
    (creds / "trainer-gpu0.key_secret").write_text("key")
    config = tmp_path / "trainer.toml"
    config.write_text('secret_file = "/from/file"\ntoken = "from-file"\n')
    env = {
        "CREDENTIALS_DIRECTORY": str(creds),
        "BATCHBUS_STATE_DIR": str(tmp_path),
        "BATCHBUS_SECRET_FILE": "/var/lib/batchbus/secret",
    }
    settings, sources = load_settings(config_file=str(config), env=env)
    # A provisioned credential beats the unit's Environment= fallback and the TOML file ...
    assert settings.secret_file == str(creds / "secret") and sources["secret_file"] == "credential secret"
    assert settings.token == "eyJ.token"
    assert settings.curve_key_file == str(creds / "trainer-gpu0.key_secret")  # key name kept: trainer-gpu0
    # ... a flag beats it, and without the credential the environment applies again.
    settings, _ = load_settings(env=env, flags={"secret_file": "/flag"})
    assert settings.secret_file == "/flag"
    (creds / "secret").unlink()
    settings, _ = load_settings(env=env)
    assert settings.secret_file == "/var/lib/batchbus/secret"


@pytest.mark.parametrize(
    "files, message",
    [
        ({"token": " \n"}, "token is empty"),
        ({"a.key_secret": "x", "b.key_secret": "y"}, "one CURVE key"),
    ],
)
def test_unusable_credentials_are_named(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_settings(env={"CREDENTIALS_DIRECTORY": str(tmp_path), "BATCHBUS_STATE_DIR": str(tmp_path)})
    with pytest.raises(ConfigError, match="No such file"):
        load_settings(env={"CREDENTIALS_DIRECTORY": str(tmp_path / "gone"), "BATCHBUS_STATE_DIR": "/x"})
