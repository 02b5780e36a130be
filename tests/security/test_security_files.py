"""Confinement of what a dataset names, and secrets kept secret."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import numpy as np
import pytest

from libbus.errors import ConfigError, DatasetError
from libbus.security.auth import load_secret
from services.atomic import write_atomic
from services.provider.sources import open_source
from tests.support.busctl import busctl
from tests.support.httpd import RangeServer

FAST = "retries=1&backoff=0.01&timeout=5"


def raw_dataset(d: Path, x_path: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "dataset.toml").write_text(
        textwrap.dedent(f"""\
        format = "raw"
        [train]
        x = "{x_path}"
        dtype = "uint8"
        shape = [1]
        """)
    )


def test_a_dataset_toml_naming_the_cluster_secret_is_refused_by_a_real_provider(state_dir, tmp_path):
    data = tmp_path / "evil"
    raw_dataset(data, str(state_dir / "secret"))  # "samples" = the cluster's HS256 secret
    out = busctl(
        "start",
        "provider",
        "--dataset",
        f"evil=file://{data}",
        "--router",
        "tcp://127.0.0.1:9",
        env={"BATCHBUS_STATE_DIR": str(state_dir)},
    )
    assert out.returncode != 0
    assert "outside the dataset's directory" in out.stderr and "Traceback" not in out.stderr, out.stderr
    raw_dataset(data, os.path.relpath(state_dir / "secret", data))  # the same by a relative path
    with pytest.raises(DatasetError, match="outside the dataset's directory"):
        open_source(f"file://{data}")


def test_a_symlink_out_of_the_dataset_is_refused_unless_the_operator_allows_it(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    np.arange(16, dtype=np.uint8).tofile(outside / "shared.u8")
    data = tmp_path / "ds"
    raw_dataset(data, "train.u8")
    (data / "train.u8").symlink_to(outside / "shared.u8")
    with pytest.raises(DatasetError, match=r"is really .*shared.u8, outside the dataset's directory"):
        open_source(f"file://{data}")
    src = open_source(f"file://{data}?allow_paths={outside}&val_fraction=0")  # the operator's explicit word
    assert src.num_samples("train") == 16
    src.close()
    # a file inside the directory, through a symlink that stays inside, is fine
    os.remove(data / "train.u8")
    np.arange(8, dtype=np.uint8).tofile(data / "real.u8")
    (data / "train.u8").symlink_to(data / "real.u8")
    src = open_source(f"file://{data}?val_fraction=0")
    assert src.num_samples("train") == 8
    src.close()


def test_http_redirects_and_manifests_stay_on_the_datasets_origin(tmp_path):
    served = tmp_path / "www"
    (served / "tok").mkdir(parents=True)
    np.arange(400, dtype="<u2").tofile(served / "tok" / "shard-00.bin")
    home, internal = RangeServer(served), RangeServer(served)  # two origins (ports) on this host
    try:
        home.redirects = {"/moved/": f"{internal.url}/tok/"}
        with pytest.raises(DatasetError, match=f"{internal.url}/tok/shard-00.bin: outside the dataset's origin"):
            open_source(f"{home.url}/moved/shard-00.bin?seq_len=9&token_bytes=2&{FAST}")
        assert not internal.requests, "the provider was pointed at another origin and went"
        (served / "tok" / "MANIFEST").write_text(f"{internal.url}/tok/shard-00.bin 800\n")
        with pytest.raises(DatasetError, match="outside the dataset's origin"):
            open_source(f"{home.url}/tok/?manifest=MANIFEST&seq_len=9&token_bytes=2&{FAST}")
        assert not internal.requests
        src = open_source(
            f"{home.url}/moved/shard-00.bin?seq_len=9&token_bytes=2&val_fraction=0&allow_origins={internal.url}&{FAST}"
        )
        assert src.num_samples("train") == 40
        src.close()
    finally:
        home.close()
        internal.close()


def test_a_world_readable_secret_is_refused_by_a_real_service(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "secret").write_text("s" * 64)
    os.chmod(state / "secret", 0o644)  # what `echo ... > secret` leaves under the usual umask
    out = busctl("start", "router", "--bind", "tcp://127.0.0.1:0", env={"BATCHBUS_STATE_DIR": str(state)})
    assert out.returncode != 0
    assert "readable by others (mode 644); chmod 600 it" in out.stderr and "Traceback" not in out.stderr, out.stderr
    with pytest.raises(ConfigError, match="readable by others"):
        load_secret(state / "secret")
    os.chmod(state / "secret", 0o600)
    assert load_secret(state / "secret") == b"s" * 64


def test_config_show_never_prints_the_token_and_a_command_line_token_is_warned_about(state_dir, make_token):
    token = make_token("admin")
    tf = state_dir / "admin.token"
    tf.write_text(token + "\n")
    for env in ({"BATCHBUS_TOKEN": token}, {"BATCHBUS_TOKEN_FILE": str(tf)}):
        out = busctl("config", "show", "--json", env={"BATCHBUS_STATE_DIR": str(state_dir), **env})
        assert out.returncode == 0, out.stderr
        assert token not in out.stdout and token[-20:] not in out.stdout and "<hidden:" in out.stdout
        out = busctl("config", "show", env={"BATCHBUS_STATE_DIR": str(state_dir), **env})
        assert token[-20:] not in out.stdout
    out = busctl(
        "jobs",
        "--token",
        token,
        "--router",
        "tcp://127.0.0.1:9",
        env={
            "BATCHBUS_STATE_DIR": str(state_dir),
            "BATCHBUS_REQUEST_TIMEOUT_S": "0.2",
            "BATCHBUS_REQUEST_RETRIES": "0",
        },
    )
    assert "warning: a token given with --token shows in 'ps'" in out.stderr


def test_checkpoints_and_models_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        path = tmp_path / "checkpoints" / "job-1" / "step-10.safetensors"
        write_atomic(path, b"weights")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o600
    assert (path.parent.stat().st_mode & 0o777, path.parent.parent.stat().st_mode & 0o777) == (0o700, 0o700)
