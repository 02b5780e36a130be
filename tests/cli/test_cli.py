"""busctl as a user meets it: settings precedence, one-line errors, tokens."""

import pytest

from libbus.config import load_settings
from libbus.errors import ConfigError
from libbus.security.auth import verify_token
from tests.support import busctl


def test_settings_precedence_is_file_then_env_then_flags(tmp_path):
    cfg = tmp_path / "bus.toml"
    cfg.write_text('router = "tcp://file:1"\nheartbeat_ms = 300\ninflight = 2\n')
    env = {"BATCHBUS_HEARTBEAT_MS": "400", "BATCHBUS_INFLIGHT": "3"}
    s, sources = load_settings(config_file=str(cfg), env=env, flags={"inflight": 9})
    assert (s.router, s.heartbeat_ms, s.inflight) == ("tcp://file:1", 400, 9)
    assert sources["router"].startswith("file") and sources["heartbeat_ms"] == "env BATCHBUS_HEARTBEAT_MS"
    assert sources["inflight"] == "flag" and s.db.endswith("router.db")


@pytest.mark.parametrize(
    "content, env, words",
    [
        ('routr = "x"', {}, "unknown setting 'routr'"),
        ("heartbeat_ms = 'often'", {}, "'heartbeat_ms' must be int"),
        ("router = ", {}, "not valid TOML"),
        ("", {"BATCHBUS_INFLIGHT": "many"}, "BATCHBUS_INFLIGHT"),
        ("inflight = -1", {}, r"inflight \(file .*\) must be 0 \(the loader sizes it\) or more"),
        ("flows = 5", {}, r"flows \(file .*\) must be 0 .* up to inflight \(4\)"),  # 0: the loader's start, 4
    ],
)
def test_bad_settings_name_their_source(tmp_path, content, env, words):
    cfg = tmp_path / "bus.toml"
    cfg.write_text(content)
    with pytest.raises(ConfigError, match=words):
        load_settings(config_file=str(cfg), env=env)


@pytest.mark.parametrize(
    "args, env, words",
    [
        (["jobs"], {}, "no signing key"),
        (["submit", "--epochs", "2"], {}, "--dataset"),
        (["start", "provider"], {}, "needs at least one --dataset"),
        (["token", "issue", "--role", "god"], {}, "unknown role"),
        (["jobs", "--config", "/nonexistent.toml"], {}, "does not exist"),
        (["submit", "/nonexistent-job.toml"], {}, "does not exist"),
        (
            ["jobs", "--router", "tcp://127.0.0.1:9"],
            {"BATCHBUS_REQUEST_TIMEOUT_S": "0.3", "BATCHBUS_REQUEST_RETRIES": "0"},
            "did not answer",
        ),
    ],
)
def test_errors_are_one_line_without_traceback(tmp_path, args, env, words):
    state = tmp_path / "state"
    if "did not answer" in words or "role" in words:
        state.mkdir()
        (state / "secret").write_text("s" * 64)
        (state / "secret").chmod(0o600)  # a readable secret is refused (tests/security/test_security_files.py)
    out = busctl(*args, env={"BATCHBUS_STATE_DIR": str(state), **env})
    assert out.returncode != 0
    assert words in out.stderr and "Traceback" not in out.stderr + out.stdout
    assert out.stderr.strip().count("\n") == 0, out.stderr


def test_unknown_flag_is_a_usage_error():
    out = busctl("jobs", "--frobnicate")
    assert out.returncode == 2 and "frobnicate" in out.stderr and "Traceback" not in out.stderr


def test_token_issue_mints_a_verifiable_token(tmp_path):
    assert busctl("token", "secret", str(tmp_path / "secret")).returncode == 0
    assert (tmp_path / "secret").stat().st_mode & 0o777 == 0o600
    out = busctl(
        "token",
        "issue",
        "--role",
        "admin",
        "--name",
        "ops",
        "--ttl",
        "60",
        env={"BATCHBUS_SECRET_FILE": str(tmp_path / "secret")},
    )
    assert out.returncode == 0, out.stderr
    claims = verify_token(out.stdout.strip(), (tmp_path / "secret").read_bytes().strip(), audience="batchbus")
    assert (claims.role, claims.sub) == ("admin", "ops")


def test_config_show_prints_every_setting_with_its_source():
    out = busctl("config", "show", "--json", env={"BATCHBUS_INFLIGHT": "7"})
    assert out.returncode == 0, out.stderr
    import json

    shown = json.loads(out.stdout)
    assert shown["inflight"] == {"value": 7, "source": "env BATCHBUS_INFLIGHT"}
    assert shown["heartbeat_ms"]["source"] == "default"
