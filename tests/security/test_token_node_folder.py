"""``busctl token node OUT`` writes what a node believes (the cluster's public key) and its token:
into a folder others may write it refuses to (they could swap the key or plant links), and a link
planted at OUT/token.pub or OUT/token is replaced, never followed to write where it points."""

from __future__ import annotations

import os

from tests.support.busctl import busctl


def _node(tmp_path, out):
    """``token node OUT`` on an administrator's machine whose key pair ``token keygen`` made."""
    env = {"BATCHBUS_STATE_DIR": str(tmp_path / "head")}
    if not (tmp_path / "head" / "token.key").exists():
        busctl("token", "keygen", env=env, check=True)
    return busctl("token", "node", str(out), "--role", "trainer", "--name", "gpu1", env=env)


def test_a_group_or_world_writable_folder_is_refused(tmp_path):
    for mode in (0o777, 0o770, 0o1777):
        out = tmp_path / f"shared{mode:o}"
        out.mkdir()
        os.chmod(out, mode)
        got = _node(tmp_path, out)
        assert got.returncode == 2 and "writable by its group or by everyone" in got.stderr, got.stderr
        assert "Traceback" not in got.stderr and not any(out.iterdir())


def test_links_planted_at_token_pub_and_token_are_replaced_not_followed(tmp_path):
    out, victim = tmp_path / "node", tmp_path / "victim"
    out.mkdir(mode=0o700)
    victim.write_text("not yours\n")
    for name in ("token.pub", "token", ".token.pub.tmp", "token.tmp"):  # the files and their temporaries
        (out / name).symlink_to(victim)
    got = _node(tmp_path, out)
    assert got.returncode == 0, got.stderr
    assert victim.read_text() == "not yours\n"
    assert not (out / "token.pub").is_symlink() and b"PUBLIC KEY" in (out / "token.pub").read_bytes()
    assert not (out / "token").is_symlink() and (out / "token").read_text().startswith("eyJ")
    assert (out / "token").stat().st_mode & 0o777 == 0o600
