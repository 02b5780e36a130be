"""Pipeline datasets (``pipeline://FILE.toml``), the factory: the bad pipelines it refuses, naming the stage,
and the chain it builds from stages listed in any order."""

from __future__ import annotations

import numpy as np
import pytest

from libbus.errors import ConfigError, DatasetError
from services.provider.sources import open_source
from tests.support.pipeline import (
    SOURCE,
    open_pipeline_fixture,  # noqa: F401 - the `open_pipeline` fixture
    read,
)

# -- the factory refuses bad pipelines, naming the stage ------------------------------------------

REFUSALS = {
    "no type": (
        SOURCE + '[[stages]]\nname = "norm"\ninput = "images"\n',
        ["stage 'norm' has no type", "give exactly one of source, normalize"],
    ),
    "two types": (
        SOURCE + '[[stages]]\nname = "aug"\ninput = "images"\nflip = {}\nnormalize = {}\n',
        ["stage 'aug' has 2 types (flip, normalize)"],
    ),
    "unknown input": (
        SOURCE + '[[stages]]\nname = "flip"\ninput = "imgs"\nflip = {}\n',
        ["stage 'flip' reads input 'imgs', which is not a stage; stages: images, flip"],
    ),
    "no input": (SOURCE + '[[stages]]\nname = "flip"\nflip = {}\n', ["stage 'flip' needs an input"]),
    "cycle": (
        SOURCE + '[[stages]]\nname = "a"\ninput = "b"\nflip = {}\n[[stages]]\nname = "b"\ninput = "a"\nflip = {}\n',
        ["stages form a cycle", "never reaches a source"],
    ),
    "self loop": (SOURCE + '[[stages]]\nname = "a"\ninput = "a"\nflip = {}\n', ["cycle: a -> a"]),
    "no source": ('[[stages]]\nname = "a"\nflip = {}\n', ["no source stage; add one with source = { uri"]),
    "only transforms": (
        '[[stages]]\nname = "a"\ninput = "b"\nflip = {}\n'
        '[[stages]]\nname = "b"\ninput = "a"\ncast = { dtype = "float16" }\n',
        ["no source stage"],
    ),
    "two sources": (
        SOURCE + '[[stages]]\nname = "more"\nsource = { uri = "mock://mnist?n=10" }\n',
        ["2 source stages (images, more)"],
    ),
    "two sinks": (
        SOURCE + '[[stages]]\nname = "a"\ninput = "images"\nflip = {}\n'
        '[[stages]]\nname = "b"\ninput = "images"\nflip = {}\n',
        ["2 sinks (a, b)", "'images' feeds 'a', 'b'"],
    ),
    "duplicate name": (SOURCE + SOURCE, ["two stages are named 'images'"]),
    "nameless": ('[[stages]]\nsource = { uri = "mock://mnist" }\n', ["stage #1 has no name"]),
    "bad name": (
        '[[stages]]\nname = "(requests)"\nsource = { uri = "mock://mnist" }\n',
        ["stage name '(requests)' may hold letters, digits, '-', '_', '.'"],
    ),
    "unknown stage key": (
        SOURCE + '[[stages]]\nname = "f"\ninput = "images"\nflip = {}\nthreads = 2\n',
        ["stage 'f': unknown key(s) threads"],
    ),
    "unknown parameter": (
        SOURCE + '[[stages]]\nname = "f"\ninput = "images"\nflip = { prob = 0.5 }\n',
        ["stage 'f' (flip): unknown parameter(s) prob; flip takes p, splits"],
    ),
    "channels": (
        SOURCE + '[[stages]]\nname = "n"\ninput = "images"\nnormalize = { mean = [0.5, 0.5] }\n',
        ["stage 'n' (normalize): mean has 2 values but samples have 3 channels"],
    ),
    "std zero": (
        SOURCE + '[[stages]]\nname = "n"\ninput = "images"\nnormalize = { std = 0 }\n',
        ["stage 'n' (normalize): std must be positive"],
    ),
    "crop too big": (
        SOURCE + '[[stages]]\nname = "c"\ninput = "images"\nrandom_crop = { size = 40, padding = 2 }\n',
        ["stage 'c' (random_crop): size [40, 40] does not fit samples of 32x32 padded by 2"],
    ),
    "one_hot twice": (
        SOURCE + '[[stages]]\nname = "h1"\ninput = "images"\none_hot = {}\n'
        '[[stages]]\nname = "h2"\ninput = "h1"\none_hot = {}\n',
        ["stage 'h2' (one_hot): needs one integer class id per sample, got labels of shape [10]"],
    ),
    "bad dtype": (
        SOURCE + '[[stages]]\nname = "c"\ninput = "images"\ncast = { dtype = "float99" }\n',
        [
            "stage 'c' (cast): dtype must be a number type (bool, int8…int64, uint8…uint64, "
            "float16…float64), "
            "got 'float99'"
        ],
    ),
    "flip tokens": (
        '[[stages]]\nname = "t"\nsource = { uri = "mock://tokens?n=10" }\n'
        '[[stages]]\nname = "f"\ninput = "t"\nflip = {}\n',
        ["stage 'f' (flip): needs image samples", "tokens samples of shape [65]"],
    ),
    "normalize tokens": (
        '[[stages]]\nname = "t"\nsource = { uri = "mock://tokens?n=10" }\n'
        '[[stages]]\nname = "n"\ninput = "t"\nnormalize = {}\n',
        ["stage 'n' (normalize): needs numeric image samples, got tokens samples"],
    ),
    "splits": (
        SOURCE + '[[stages]]\nname = "f"\ninput = "images"\nflip = { splits = ["training"] }\n',
        ["stage 'f' (flip): splits must be a list of train, val, test"],
    ),
    "bad source": (
        '[[stages]]\nname = "src"\nsource = { uri = "mock://imagenet" }\n',
        ["stage 'src' (source): mock://imagenet: unknown mock dataset 'imagenet'"],
    ),
    "nested pipeline": (
        '[[stages]]\nname = "src"\nsource = { uri = "pipeline:///x.toml" }\n',
        ["stage 'src' (source): a pipeline's source cannot be another pipeline"],
    ),
    "top key": ("threads = 4\n" + SOURCE, ["unknown key(s) threads; a pipeline file has stages, seed"]),
    "no stages": ("seed = 1\n", ["no [[stages]]"]),
    "source with input": (
        SOURCE + '[[stages]]\nname = "more"\ninput = "images"\nsource = { uri = "mock://mnist" }\n',
        ["2 source stages"],
    ),
    "lone source with input": (
        '[[stages]]\nname = "s"\ninput = "s"\nsource = { uri = "mock://mnist" }\n',
        ["stage 's' is a source and takes no input"],
    ),
    "bad chunk": ("chunk = 0\n" + SOURCE, ["chunk must be a positive integer, got 0"]),
    "bad seed": ("seed = -1\n" + SOURCE, ["seed must be a non-negative integer"]),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_the_factory_refuses_a_bad_pipeline_naming_the_stage(open_pipeline, tmp_path, case):
    text, expected = REFUSALS[case]
    with pytest.raises((ConfigError, DatasetError)) as info:
        open_pipeline(text)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'p.toml'}: "), message  # names the file, once
    assert message.count("p.toml") == 1, message
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_a_missing_or_malformed_file_is_a_dataset_or_config_error(tmp_path):
    with pytest.raises(DatasetError, match="pipeline file .*nope.toml does not exist"):
        open_source(f"pipeline://{tmp_path}/nope.toml")
    (tmp_path / "bad.toml").write_text("[[stages]\n")
    with pytest.raises(ConfigError, match="bad.toml is not valid TOML"):
        open_source(f"pipeline://{tmp_path}/bad.toml")


def test_stages_may_be_listed_in_any_order_and_declare_their_output(open_pipeline):
    """The chain follows the inputs, not the file order; shapes and dtypes flow through it."""
    p = open_pipeline("""
        [[stages]]
        name = "hot"
        input = "small"
        one_hot = {}
        [[stages]]
        name = "small"
        input = "half"
        random_crop = { size = [24, 20] }
        [[stages]]
        name = "images"
        source = { uri = "mock://cifar10?n=50" }
        [[stages]]
        name = "half"
        input = "images"
        cast = { dtype = "float16", label_dtype = "int32" }
        """)
    assert [s.name for s in p.stages] == ["images", "half", "small", "hot"]
    info = p.info()
    assert (info["sample_shape"], info["dtype"]) == ([3, 24, 20], "float16")
    assert (info["label_shape"], info["label_dtype"], info["num_classes"]) == ([10], "float32", 10)
    assert info["source_uri"] == "mock://cifar10?n=50" and info["stages"][0] == {"name": "images", "type": "source"}
    x, y = read(p, "train", range(10))
    assert x.shape == (10, 3, 24, 20) and x.dtype == np.float16 and y.shape == (10, 10)
