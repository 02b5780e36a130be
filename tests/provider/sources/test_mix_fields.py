"""weighted:// mixes of named-field sources: two image folders served as fields mix through a real
provider into dict batches, in the mix's proportions and with each component's own bytes, through
both deliveries; a mix of Parquet field sources keeps its variable fields; an x/y dataset beside a
named-field one, or sources whose fields disagree, are refused when the mix is opened (by busctl,
without a traceback), naming the source and the field."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from libbus import RemoteLoader
from libbus.errors import ConfigError, DatasetError
from services.provider.handler import ProviderHandler
from services.provider.sources import open_source
from tests.support.busctl import busctl
from tests.support.contract import check_fields_contract
from tests.support.images import image_bytes, write_imagefolder
from tests.support.text import document, text_pipeline, write_parquet_text, write_text, write_tokenizer

SIZE = 12


def write_mix(path: Path, *entries: tuple[str, int]) -> str:
    path.write_text("".join(f'[[sources]]\nuri = "{uri}"\nweight = {w}\n' for uri, w in entries))
    return f"weighted://{path}"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    """Two ImageFolder trees with train and val, of images no other tree has (b: PNGs of other numbers)."""
    root = tmp_path_factory.mktemp("mix")
    a = write_imagefolder(root / "a", per_class=5, classes=2, splits=("train", "val"))
    b = root / "b"
    for split in ("train", "val"):
        for c in range(2):
            (b / split / f"class{c}").mkdir(parents=True)
            for n in range(3):
                (b / split / f"class{c}" / f"{n}.png").write_bytes(image_bytes(c, 500 + n, "PNG"))
    return a, b


def test_two_image_folders_mix_into_dict_batches_of_their_own_bytes(
    folders, tmp_path, router, start_provider, make_token, state_dir
):
    a, b = (f"file://{d}?size={SIZE}&fields=image,label" for d in folders)
    mix = write_mix(tmp_path / "mix.toml", (a, 3), (b, 1))
    provider = start_provider(f"mix={mix}")
    shown = busctl("datasets", "--router", router.endpoint, "--state-dir", str(state_dir), timeout=60)
    assert shown.returncode == 0 and f"fields     image uint8 (3, {SIZE}, {SIZE}), label int64 ()" in shown.stdout
    alone = [open_source(a), open_source(b)]
    refs = [s.read_fields("train", np.arange(s.num_samples("train"))) for s in alone]
    total = sum(s.num_samples("train") for s in alone)
    for shm in (False, True):
        with RemoteLoader(
            "mix", provider=provider.endpoint, token=make_token(), batch_size=5, shuffle=False, shm=shm
        ) as loader:
            assert loader.transport == ("shm" if shm else "socket")
            batches = list(loader)
        assert all(isinstance(bt, dict) and set(bt) == {"image", "label"} for bt in batches)
        images = np.concatenate([bt["image"].numpy() for bt in batches])
        labels = np.concatenate([bt["label"].numpy() for bt in batches])
        assert images.shape == (total, 3, SIZE, SIZE) and images.dtype == np.uint8
        seen = [0, 0]
        for i, (img, label) in enumerate(zip(images, labels)):
            # each position is the next sample of one component, byte for byte as it serves it alone
            src = [j for j in (0, 1) if np.array_equal(img, refs[j]["image"][seen[j] % len(refs[j]["label"])])]
            assert len(src) == 1, f"position {i} is not the next sample of exactly one component"
            j = src[0]
            assert label == refs[j]["label"][seen[j] % len(refs[j]["label"])]
            seen[j] += 1
            assert abs(seen[1] - (i + 1) / 4) < 1, f"after {i + 1} positions the 1:3 component has {seen[1]}"
    for s in alone:
        s.close()


def test_a_mix_of_parquet_field_sources_keeps_variable_fields(tmp_path):
    for name, rows in (("p", [[1, 2], [3], []]), ("q", [[7, 8, 9], [10]])):
        (tmp_path / name).mkdir()
        table = pa.table({"ids": rows, "text": [f"{name}{i}" for i in range(len(rows))]})
        pq.write_table(table, tmp_path / name / "train.parquet")
    uris = [f"parquet://{tmp_path / n}?val_fraction=0&fields=ids,text&max_bytes={m}" for n, m in (("p", 64), ("q", 99))]
    mix = open_source(write_mix(tmp_path / "mix.toml", (uris[0], 1), (uris[1], 1)))
    assert [f.describe() for f in mix.fields] == ["ids int64 (?,)", "text str *"]
    assert mix.fields[0].max_bytes == 99  # the largest any source declares: every sample fits
    batch = mix.read_fields("train", np.arange(5))
    assert sorted(batch["text"]) == ["p0", "p1", "p2", "q0", "q1"]
    by_text = dict(zip(batch["text"], batch["ids"]))
    assert by_text["q0"].tolist() == [7, 8, 9] and by_text["p2"].tolist() == []


@pytest.mark.parametrize(
    ("second", "message"),
    [
        ("mock://mnist?n=20", r"source 2 \(mock://mnist\?n=20\) is an x/y dataset but .*source 1 .* has named fields"),
        (
            "DIR?size=16&fields=image,label",
            r"source 2 .* has field image uint8 \(3, 16, 16\) but .* image uint8 \(3, 12",
        ),
        ("DIR?size=12&fields=label,image", "has fields label, image but .* has image, label"),
        ("mock://fields?n=10", "has fields image, tokens, text, label but .* has image, label"),
        ("DIR?fields=image,label", r"has field image uint8 \(\?, \?, 3\) but"),
    ],
)
def test_sources_whose_fields_disagree_are_refused_at_open(folders, tmp_path, second, message):
    first = f"file://{folders[0]}?size=12&fields=image,label"
    mix = write_mix(tmp_path / "mix.toml", (first, 1), (second.replace("DIR", f"file://{folders[1]}"), 1))
    with pytest.raises(DatasetError, match=message):
        open_source(mix)


def test_the_careless_operator_gets_the_reason_from_busctl_not_a_traceback(folders, tmp_path):
    mix = write_mix(tmp_path / "mix.toml", ("mock://mnist?n=20", 1), (f"file://{folders[0]}?size=12&fields=image", 1))
    out = busctl("start", "provider", "--dataset", f"mix={mix}", "--state-dir", str(tmp_path / "state"), timeout=30)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "source 1 (mock://mnist?n=20) is an x/y dataset but" in out.stderr
    assert "source 2 (file://" in out.stderr and "has named fields (image uint8 (3, 12, 12))" in out.stderr


def test_text_lines_and_a_parquet_text_column_mix_as_a_pipelines_source(tmp_path):
    lines = write_text(tmp_path / "lines", train=6)
    column = write_parquet_text(tmp_path / "column", train=4)
    mix = write_mix(tmp_path / "mix.toml", (f"file://{lines}?encoded=1&val_fraction=0", 3),
                    (f"parquet://{column}?encoded=1&val_fraction=0", 2))  # fmt: skip
    tokenizer = Tokenizer.from_file(str(write_tokenizer(tmp_path / "tok.json")))
    pipeline = open_source(text_pipeline(tmp_path / "p.toml", mix, tmp_path / "tok.json", length=8))
    try:
        x = np.empty((10, 9), pipeline.dtype)
        pipeline.serve_into("train", np.arange(10), x, np.empty((10, 0), np.int64))
    finally:
        pipeline.close()
    eos = tokenizer.token_to_id("</s>")
    want = sorted((tokenizer.encode(document(n)).ids + [eos])[:9] for n in [*range(6), *range(4)])
    assert sorted(x.tolist()) == want  # lines hold documents 0..5, the column 0..3: each row once
    with pytest.raises(ConfigError, match=r"dataset 'text' \(weighted://.*\) holds encoded images or text, which "
                       "have no fixed shape: make it a pipeline's source"):  # fmt: skip
        ProviderHandler({"text": open_source(mix)})  # served as it is, every batch would fail: refused at start
    bad = write_mix(tmp_path / "bad.toml", (f"file://{lines}?encoded=1", 1), ("mock://mnist", 1))
    with pytest.raises(DatasetError, match=r"source 2 \(mock://mnist\) has kind image but .* has encoded"):
        open_source(bad)


def test_a_mix_of_decoded_image_folders_keeps_the_source_contract(folders, tmp_path):
    uris = [f"file://{d}?fields=image,label&max_bytes=20000" for d in folders]
    mix = open_source(write_mix(tmp_path / "mix.toml", (uris[0], 1), (uris[1], 2)))
    try:
        assert [f.describe() for f in mix.fields] == ["image uint8 (?, ?, 3)", "label int64 ()"]
        check_fields_contract(mix)  # read_fields deterministic, served byte for byte, splits refused
    finally:
        mix.close()
