"""Text datasets written by tests: a tiny word-level tokenizer trained on the spot (no hub download) and
documents with a learnable order (counting words from a random start), as lines or WebDataset ``.txt``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from libbus.wire.messages import SubmitJob
from tests.support import wait_job

WORDS = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen".split()
SPECIALS = ["<pad>", "</s>", "<unk>"]


def document(number: int) -> str:
    """Words counted on from a start, wrapping: each next word is fully determined by the one before."""
    rng = np.random.default_rng(number)
    start, length = int(rng.integers(len(WORDS))), int(rng.integers(6, 40))
    return " ".join(WORDS[(start + k) % len(WORDS)] for k in range(length))


def write_tokenizer(path: Path) -> Path:
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=SPECIALS))
    tok.save(str(path))
    return path


def write_text(root: Path, train: int, test: int = 0) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.txt").write_text("".join(document(n) + "\n" for n in range(train)))
    if test:
        (root / "test.txt").write_text("".join(document(100_000 + n) + "\n" for n in range(test)))
    return root


def text_pipeline(path: Path, source_uri: str, tokenizer: Path, length: int, join: bool = False) -> str:
    """A pipeline file tokenizing ``source_uri`` (with ``</s>`` ending each document) and packing it: one
    sample per document padded with 0, or with ``join`` the documents' stream cut into samples."""
    pack = "join = true" if join else "pad_id = 0"
    path.write_text(
        f"""
[[stages]]
name = "text"
source = {{ uri = "{source_uri}" }}

[[stages]]
name = "tok"
input = "text"
tokenize = {{ tokenizer = "{tokenizer}", eos = "</s>" }}

[[stages]]
name = "pack"
input = "tok"
pack = {{ length = {length}, {pack} }}
"""
    )
    return f"pipeline://{path}"


def write_parquet_text(root: Path, train: int, test: int = 0, row_group: int = 64) -> Path:
    """The same documents as :func:`write_text`, as a hub exports text: ``train.parquet`` (``test``) with
    a string column ``text`` beside a numeric ``id``, in row groups of ``row_group`` rows."""
    import pyarrow as pa  # the parquet extra: only the tests that use it import it
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    for split, first, n in (("train", 0, train), ("test", 100_000, test)):
        if n:
            numbers = list(range(first, first + n))
            table = pa.table({"id": pa.array(numbers, pa.int64()), "text": [document(k) for k in numbers]})
            pq.write_table(table, root / f"{split}.parquet", row_group_size=row_group)
    return root


def train_tiny_lm(tmp_path: Path, source_uri: str, start_provider, admin, epochs: int, join: bool = False) -> dict:
    """A tiny-lm job through router, provider and trainer on ``source_uri`` (``?encoded=1`` texts)
    tokenized by the provider; its result once it succeeded, with what its loss did printed."""
    tok_path = write_tokenizer(tmp_path / "tokenizer.json")
    uri = text_pipeline(tmp_path / "p.toml", source_uri, tok_path, 24, join)
    start_provider(f"counting={uri}", assigned_only=True)
    spec = {"dataset": "counting", "model": "tiny-lm", "epochs": epochs, "batch_size": 32, "lr": 0.005, "seed": 0}
    done = wait_job(admin, admin.request(SubmitJob(spec=spec)).job, timeout=90)
    assert done["state"] == "succeeded", done.get("error")
    result = done["result"]
    print(
        f"tiny-lm on {source_uri}: train losses {[round(e['train_loss'], 3) for e in result['history']]}, "
        f"val {result['val_loss']:.3f}, test {result['test_loss']:.3f}"
    )
    return result
