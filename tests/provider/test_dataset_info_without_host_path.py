"""A reader is told what a dataset holds, not where the provider's operator keeps it: DatasetInfo
and Resolve give a trainer's token no ``uri``, ``path`` or ``source_uri`` (each held the provider's
absolute directory), nor a tenant's admin token scoped to its datasets or jobs; the operator's
unrestricted admin session still sees them (``busctl data``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson

from libbus.wire.messages import DatasetInfoRequest, Resolve


def _npy_dataset(root: Path, n: int = 16) -> Path:
    root.mkdir(parents=True)
    np.save(root / "train_x.npy", np.arange(n * 4, dtype=np.float32).reshape(n, 4))
    np.save(root / "train_y.npy", np.arange(n, dtype=np.int64) % 2)
    return root


def test_a_trainer_is_not_shown_the_providers_filesystem_path(tmp_path, router, start_provider, client_for, make_token):
    data = _npy_dataset(tmp_path / "operator-secret-dir")
    mix = tmp_path / "operator-secret-dir" / "mix.toml"
    mix.write_text(f"[[sources]]\nuri = 'file://{data}'\nweight = 1\n")
    provider = start_provider(f"d=file://{data}", f"m=weighted://{mix}")
    token = make_token("trainer", sub="tenant", datasets=["d", "m"])
    # the attacker: a tenant's trainer token asking both the provider and the router
    info = client_for(provider.endpoint, token=token).request(DatasetInfoRequest(dataset="d")).info
    resolved = client_for(router.endpoint, token=token).request(Resolve(dataset="d")).info
    mixed = client_for(provider.endpoint, token=token).request(DatasetInfoRequest(dataset="m")).info
    assert str(tmp_path) not in orjson.dumps(mixed).decode() and mixed["sources"], mixed  # a mix's members too
    for shown in (info, resolved):
        text = orjson.dumps(shown).decode()
        assert str(data) not in text and str(tmp_path) not in text, shown
        assert not {"uri", "path", "source_uri"} & shown.keys()
        # what a reader needs is still there
        assert shown["splits"]["train"]["num_samples"] > 0 and shown["sample_shape"] == [4]
        assert shown["format"] == "npy"
    # a tenant's admin token, scoped to its dataset (or to its jobs), is a tenant's: no path either
    for scope in ({"datasets": ["d"]}, {"jobs": ["j1"]}):
        tenant = make_token("admin", sub="tenant-admin", **scope)
        asked = client_for(provider.endpoint, role="admin", token=tenant).request(DatasetInfoRequest(dataset="d"))
        shown = [asked.info]
        if "datasets" in scope:  # the router resolves only datasets inside the scope
            shown.append(client_for(router.endpoint, role="admin", token=tenant).request(Resolve(dataset="d")).info)
        for info in shown:
            assert str(tmp_path) not in orjson.dumps(info).decode(), (scope, info)
            assert info["splits"]["train"]["num_samples"] > 0
    # the operator (an unrestricted admin) still sees where the data is
    admin = client_for(provider.endpoint, role="admin", token=make_token("admin", sub="operator"))
    full = admin.request(DatasetInfoRequest(dataset="d")).info
    assert full["path"] == str(data) and str(data) in full["uri"]
    resolved = client_for(router.endpoint, role="admin", token=make_token("admin", sub="operator"))
    assert str(data) in resolved.request(Resolve(dataset="d")).info["uri"]
