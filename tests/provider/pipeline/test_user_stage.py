"""Pipeline ``user`` stages: operator-installed ``module:function`` code, allowed only by the provider's
own settings, called per sample with a generator of (seed, epoch, split, stage, index)."""

from __future__ import annotations

import re
import sys
import textwrap

import numpy as np
import pytest

from libbus.errors import ConfigError, DatasetError
from libbus.loader.remote import RemoteLoader
from services.provider.sources import open_source
from tests.support.pipeline import SOURCE, read

ALLOWED = ["tests.support.user_transforms"]


def pipeline_file(tmp_path, function: str, extra: str = "") -> str:
    path = tmp_path / "user.toml"
    stage = f'[[stages]]\nname = "u"\ninput = "images"\nuser = {{ function = "{function}"{extra} }}\n'
    path.write_text(textwrap.dedent(SOURCE) + stage)
    return f"pipeline://{path}"


def test_a_user_function_runs_per_sample_deterministically(tmp_path):
    uri = pipeline_file(tmp_path, "tests.support.user_transforms:jitter")
    p = open_source(uri, user_modules=ALLOWED)
    plain = open_source("mock://cifar10?n=200")
    try:
        x0, y0 = read(p, "train", [3, 4, 5], epoch=0)
        again, _ = read(p, "train", [5, 3], epoch=0)  # another request, order and chunking
        x1, _ = read(p, "train", [3, 4, 5], epoch=1)
        base, labels = plain.read("train", np.array([3, 4, 5]))
        assert np.array_equal(again, x0[[2, 0]]) and not np.array_equal(x0, x1)
        assert 0 < np.abs(x0 - base).max() < 1 and np.array_equal(y0, labels)
        val, _ = read(p, "val", [1, 2])  # only train is augmented by default
        assert np.array_equal(val, plain.read("val", np.array([1, 2]))[0])
    finally:
        p.close()


@pytest.mark.parametrize(
    "function, allowed, message",
    [
        ("tests.support.forbidden_transforms:steal", ALLOWED, "'tests.support.forbidden_transforms' is not in this"),
        ("os:system", ALLOWED, "'os' is not in this provider's user_modules"),
        ("tests.support.user_transforms:jitter", [], "user_modules (none)"),
        ("tests.support:user_transforms", ALLOWED, "'tests.support' is not in"),  # a parent is not allowed
        ("tests.support.user_transforms:_private", ALLOWED, "is not a public function name"),
        ("tests.support.user_transforms", ALLOWED, "must be 'module:function'"),
        ("tests.support.user_transforms:np", ALLOWED, "has no function 'np'"),
    ],
)
def test_code_not_named_by_the_providers_own_settings_is_refused(tmp_path, function, allowed, message):
    """An attacker's (or a careless) pipeline file names code; only the operator's settings allow it."""
    uri = pipeline_file(tmp_path, function)
    with pytest.raises(ConfigError, match="stage 'u' \\(user\\)") as err:
        open_source(uri, user_modules=allowed)
    assert message in str(err.value)
    assert "tests.support.forbidden_transforms" not in sys.modules  # refused before any import


def test_a_uri_cannot_grant_itself_a_module(tmp_path):
    uri = pipeline_file(tmp_path, "tests.support.user_transforms:jitter")
    with pytest.raises(ConfigError, match="not in this provider's user_modules"):
        open_source(f"{uri}?user_modules=tests.support.user_transforms")


def test_a_bad_output_fails_the_request_not_the_provider(tmp_path):
    for function, message in (
        ("to_int16", "returned a sample of shape (3, 32, 32) int16"),
        ("not_a_dict", "not a dict"),
    ):
        p = open_source(pipeline_file(tmp_path, f"tests.support.user_transforms:{function}"), user_modules=ALLOWED)
        try:
            with pytest.raises(DatasetError, match=re.escape(message)):
                read(p, "train", [1])
        finally:
            p.close()


def test_a_provider_serves_a_user_stage_its_settings_allow(start_provider, make_token, tmp_path):
    uri = pipeline_file(tmp_path, "tests.support.user_transforms:label_plus_one")
    provider = start_provider(f"aug={uri}", user_modules=ALLOWED)
    with RemoteLoader("aug", provider=provider.endpoint, token=make_token(), batch_size=50, shuffle=False) as loader:
        labels = np.concatenate([y.numpy() for _, y in loader])
    want = open_source("mock://cifar10?n=200").labels("train", np.arange(len(labels))) + 1
    assert np.array_equal(labels, want)
    with pytest.raises(ConfigError, match="not in this provider's user_modules"):
        start_provider(f"aug={uri}")
