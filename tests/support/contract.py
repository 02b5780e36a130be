"""The contract every dataset source keeps, written once and run over every scheme (torchdata's
``run_test_save_load_state`` habit): ``tests/provider/sources/test_sources_contract.py`` builds one source per scheme and
calls :func:`check_source_contract` on it.

What a user relies on, whatever the URI:

- DatasetInfo agrees with what is read: sizes, shapes, dtypes; the test split is private;
- ``read`` and ``read_into`` (a shared-memory slot stands in for its destination) give the same bytes,
  the same bytes every time, and the reference's bytes where the test wrote the data itself;
- the provider (its socket-free handler, the code behind every BatchRequest) serves those bytes, and
  refuses an index outside the split and the test split with the typed errors a client gets.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import Future

import numpy as np
import pytest

from libbus.errors import DatasetError, OutOfRange, SplitPrivate
from libbus.wire.fields import Field, decode_frames
from libbus.wire.messages import BatchRequest
from services.provider.handler import ProviderHandler
from services.provider.sources import SPLITS, Source

from .busctl import REPO

__all__ = ["check_encoded_contract", "check_fields_contract", "check_source_contract", "peak_rss", "some_indices"]

Reference = dict[str, tuple[np.ndarray, np.ndarray]]


def some_indices(n: int, rng: np.random.Generator) -> np.ndarray:
    """Unsorted, duplicated and contiguous indices, first and last included."""
    return (
        np.r_[
            rng.permutation(n)[:7], 0, 0, np.arange(min(n, 5)), n - 1, np.arange(max(0, n - 3), n)[::-1], n // 2
        ].astype(np.int64)
        % n
    )


def _answer(handler: ProviderHandler, msg: BatchRequest):
    """The handler's reply to ``msg``: a pipeline's is a Future (read off the loop; the server sends
    it when done)."""
    reply = handler.batch(None, msg)
    return reply.result(timeout=60) if isinstance(reply, Future) else reply


def _served(handler: ProviderHandler, split: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    reply = _answer(handler, BatchRequest(dataset="d", split=split, frames=[indices.astype("<i8").tobytes()]))
    (xs, ys), (xd, yd) = reply.shapes, reply.dtypes
    x = np.frombuffer(bytes(reply.frames[0]), np.dtype(xd)).reshape(xs)
    y = np.frombuffer(bytes(reply.frames[1]), np.dtype(yd)).reshape(ys)
    return x, y


def _as_bytes(value) -> list[bytes]:
    """A field's batch as one byte string per sample (with its shape), to compare exactly."""
    if isinstance(value, np.ndarray):
        return [value.tobytes(), repr(value.shape).encode(), value.dtype.str.encode()]
    return [
        v.encode() if isinstance(v, str) else bytes(v) if isinstance(v, bytes) else v.tobytes() + repr(v.shape).encode()
        for v in value
    ]


def check_fields_contract(source: Source, reference=None, seed: int = 0) -> None:
    """The contract for a source of named fields (not x/y): DatasetInfo describes its fields,
    ``read_fields`` is deterministic (and equals ``reference(split, indices)`` when given), the
    provider serves those bytes field by field, and refuses what lies outside a split and the test
    split."""
    rng = np.random.default_rng(seed)
    info = source.info()
    assert [Field.from_info(d) for d in info["fields"]] == source.fields and not source.xy
    assert "sample_shape" not in info, "old x/y keys would misdescribe a multi-field dataset"
    handler = ProviderHandler({"d": source}, assigned_only=False)
    try:
        for split in ("train", "val"):
            n = source.num_samples(split)
            idx = some_indices(n, rng)
            batch = source.read_fields(split, idx)
            again = source.read_fields(split, idx)
            want = {name: _as_bytes(batch[name]) for name in batch}
            assert want == {name: _as_bytes(again[name]) for name in again}, "not deterministic"
            if reference is not None:
                ref = reference(split, idx)
                assert want == {name: _as_bytes(ref[name]) for name in ref}, split
            reply = _answer(handler, BatchRequest(dataset="d", split=split, frames=[idx.astype("<i8").tobytes()]))
            served = decode_frames(reply.names, reply.shapes, reply.dtypes, reply.frames)
            assert {name: _as_bytes(served[name]) for name in served} == want, split
            with pytest.raises(OutOfRange, match=f"outside {split}"):
                handler.batch(None, BatchRequest(dataset="d", split=split, range=[n - 1, n + 1]))
        with pytest.raises(SplitPrivate):
            handler.batch(None, BatchRequest(dataset="d", split="test", range=[0, 1]))
    finally:
        handler.close()


def check_encoded_contract(source: Source, reference: dict[str, list[str]] | None = None, seed: int = 0) -> None:
    """The contract for a source of encoded samples (text lines, image bytes) that a pipeline's ``decode``
    or ``tokenize`` stage reads: DatasetInfo's sizes and a private test split; ``read`` deterministic and,
    given ``reference`` (split → texts), the texts as stored; refused where a fixed shape is needed."""
    rng = np.random.default_rng(seed)
    info = source.info()
    assert info["kind"] == "encoded" and source.kind == "encoded"
    assert info["splits"]["test"] == {"num_samples": source.num_samples("test"), "available": False, "shuffle": False}
    for split in SPLITS:
        assert info["splits"][split]["num_samples"] == source.num_samples(split), split
        if reference is not None and split in reference:
            assert source.num_samples(split) == len(reference[split]), split
    for split in ("train", "val"):
        n = source.num_samples(split)
        if n == 0:
            continue
        idx = some_indices(n, rng)
        x, _ = source.read(split, idx)
        again, _ = source.read(split, idx)
        assert [(s.data, s.text, s.label) for s in x] == [(s.data, s.text, s.label) for s in again], "not deterministic"
        if reference is not None and split in reference:
            assert [s.text for s in x] == [reference[split][i] for i in idx], split
        with pytest.raises(DatasetError, match="no fixed shape"):
            source.read_into(split, idx, np.empty(len(idx), object), np.empty(len(idx), np.int64))


def check_source_contract(source: Source, reference: Reference | None = None, seed: int = 0) -> None:
    """Check ``source`` keeps the contract; ``reference``: split → (samples, labels) it must serve."""
    rng = np.random.default_rng(seed)
    info = source.info()
    # DatasetInfo agrees with the source and with what is read
    assert info["sample_shape"] == list(source.sample_shape) and info["dtype"] == source.dtype.name
    assert info["label_shape"] == list(source.label_shape) and info["label_dtype"] == source.label_dtype.name
    assert info["splits"]["test"] == {"num_samples": source.num_samples("test"), "available": False, "shuffle": False}
    for split in SPLITS:
        assert info["splits"][split]["num_samples"] == source.num_samples(split), split
        if reference is not None and split in reference:
            assert source.num_samples(split) == len(reference[split][0]), split
    handler = ProviderHandler({"d": source}, assigned_only=False)
    try:
        for split in ("train", "val"):
            n = source.num_samples(split)
            if n == 0:
                continue
            idx = some_indices(n, rng)
            x, y = source.read(split, idx)
            assert x.shape == (len(idx), *source.sample_shape) and x.dtype == source.dtype, split
            assert y.shape == (len(idx), *source.label_shape) and y.dtype == source.label_dtype, split
            # read_into fills the buffers it is given, as it does a ring slot
            x2 = np.full_like(x, 7)
            y2 = np.full_like(y, -1)
            source.read_into(split, idx, x2, y2)
            assert x2.tobytes() == x.tobytes() and y2.tobytes() == y.tobytes(), split
            again = source.read(split, idx)
            assert again[0].tobytes() == x.tobytes() and again[1].tobytes() == y.tobytes(), "not deterministic"
            if reference is not None and split in reference:
                rx, ry = reference[split]
                assert x.tobytes() == np.ascontiguousarray(rx[idx], source.dtype).tobytes(), split
                assert y.tobytes() == np.ascontiguousarray(ry[idx], source.label_dtype).tobytes(), split
            # the provider serves exactly those bytes, and refuses what lies outside the split
            sx, sy = _served(handler, split, idx)
            assert sx.tobytes() == x.tobytes() and sy.tobytes() == y.tobytes(), split
            with pytest.raises(OutOfRange, match=f"outside {split}"):
                handler.batch(None, BatchRequest(dataset="d", split=split, range=[n - 1, n + 1]))
            with pytest.raises(OutOfRange):
                _served(handler, split, np.array([0, n], np.int64))
        with pytest.raises(SplitPrivate):
            handler.batch(None, BatchRequest(dataset="d", split="test", range=[0, 1]))
    finally:
        handler.close()


PEAK_RSS = """
import sys
import numpy as np
from services.provider.sources import open_source
source = open_source(sys.argv[1])
n = source.num_samples("train")
x = np.empty((64, *source.sample_shape), source.dtype)
y = np.empty((64, *source.label_shape), source.label_dtype)
rng = np.random.default_rng(0)
for start in range(0, n - 64, 64):  # every sample once, shuffled inside each batch
    source.read_into("train", rng.permutation(np.arange(start, start + 64)), x, y)
source.close()
# VmHWM, not ru_maxrss: ru_maxrss keeps the peak of the forked parent across exec
print(int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024)
"""


def peak_rss(uri: str) -> int:
    """The peak resident memory of a process that opens ``uri`` and reads all of its train split."""
    out = subprocess.run([sys.executable, "-c", PEAK_RSS, uri], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])
