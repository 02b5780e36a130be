"""Samples with named fields through a real provider: every field byte for byte against the source, over
the socket and through the shared-memory ring, padded and as lists; a batch beyond the declared maxima
refused naming the field; a peer of the old wire version told both versions; hostile offsets refused."""

from __future__ import annotations

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from libbus import PROTOCOL
from libbus.connect.client import Client, Identity
from libbus.errors import BadRequest, BusError, ConfigError, TooLarge
from libbus.loader.remote import RemoteLoader
from libbus.security.admission import admit_client
from libbus.wire.fields import Field, decode_frames, encode_frames, pack_slot, slot_bytes_for, unpack_slot
from libbus.wire.messages import BatchRequest, Evaluate, decode
from services.provider.handler import ProviderHandler
from services.provider.sources import open_source
from tests.support.fuzz import FUZZ, batch_request

URI = "mock://fields?n=50"


@pytest.fixture
def fields_provider(start_provider):
    return start_provider(f"multi={URI}", "big=mock://fields?n=20&max=100", "mnist=mock://mnist?n=100")


def _reference(split: str, indices: np.ndarray) -> dict:
    return open_source(URI).read_fields(split, indices)


def _check_batch(batch: dict, want: dict, collate: str) -> None:
    assert set(batch) == {"image", "tokens", "text", "label"} | (
        {"image_lengths", "tokens_lengths"} if collate == "pad" else set()
    )
    assert batch["text"] == want["text"] and all(isinstance(t, str) for t in batch["text"])
    assert batch["label"].dtype == torch.int64 and batch["label"].numpy().tobytes() == want["label"].tobytes()
    for name in ("image", "tokens"):
        for row, ref in enumerate(want[name]):
            if collate == "list":
                got = batch[name][row].numpy()
            else:
                sizes = batch[f"{name}_lengths"][row].tolist()
                sizes = sizes if isinstance(sizes, list) else [sizes]
                assert sizes == list(ref.shape[: len(sizes)])  # the varying dims lead: (?, ?, 3), (?,)
                got = batch[name][(row, *(slice(0, s) for s in ref.shape))].numpy()
                pad = batch[name][row].clone()
                pad[tuple(slice(0, s) for s in ref.shape)] = 0
                assert not pad.any(), "padding must be zeros"
            assert got.shape == ref.shape and got.dtype == ref.dtype and got.tobytes() == ref.tobytes()


@pytest.mark.parametrize("shm", [False, True])
@pytest.mark.parametrize("collate", ["pad", "list"])
def test_every_field_arrives_byte_for_byte(fields_provider, make_token, shm, collate):
    with RemoteLoader(
        "multi",
        provider=fields_provider.endpoint,
        token=make_token(),
        batch_size=7,
        shuffle=False,
        shm=shm,
        collate=collate,
    ) as loader:
        assert loader.transport == ("shm" if shm else "socket")
        held = list(loader)  # held all at once: a batch stays what it was while held
        assert len(held) == 8
        for i, batch in enumerate(held):
            _check_batch(batch, _reference("train", np.arange(7 * i, min(50, 7 * i + 7))), collate)


def test_an_xy_dataset_still_yields_a_tuple_beside_a_multi_field_one(fields_provider, make_token):
    with RemoteLoader("mnist", provider=fields_provider.endpoint, token=make_token(), batch_size=10) as loader:
        x, y = next(iter(loader))
        assert x.shape == (10, 1, 28, 28) and y.shape == (10,)
        assert loader.info["sample_shape"] == [1, 28, 28]
        assert loader.info["fields"] == [
            {"name": "x", "dtype": "float32", "shape": [1, 28, 28]},
            {"name": "y", "dtype": "int64", "shape": []},
        ]


@pytest.mark.parametrize("shm", [False, True])
def test_a_batch_beyond_the_declared_maximum_is_refused_naming_the_field(fields_provider, make_token, shm):
    with RemoteLoader("big", provider=fields_provider.endpoint, token=make_token(), batch_size=5, shm=shm) as loader:
        assert loader.transport == ("shm" if shm else "socket")
        with pytest.raises(TooLarge, match=r"field 'image'.* holds \d+ bytes; the field declares at most 100"):
            list(loader)


def test_a_slot_too_small_for_a_batch_is_refused_naming_field_and_sizes():
    fields = [Field("a", "int64", ()), Field("img", "uint8", (None,), 8)]
    batch = {"a": np.arange(3), "img": [np.zeros(8, np.uint8)] * 3}
    need = slot_bytes_for(fields, 3)
    slot = memoryview(bytearray(need))
    shapes, dtypes, _ = pack_slot(fields, batch, 3, slot)
    assert [len(v) for v in unpack_slot(["a", "img"], shapes, dtypes, slot)["img"]] == [8] * 3
    with pytest.raises(BusError, match=r"field 'img' needs 24 bytes at offset 128; the slot holds 140"):
        pack_slot(fields, batch, 3, memoryview(bytearray(140)))


def test_a_peer_of_the_old_wire_version_is_told_both_versions(fields_provider, make_token):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    admit_client(sock, make_token())  # the connection handshake is the same in both versions
    try:
        sock.connect(fields_provider.endpoint)
        sock.send_multipart(
            [b"BB1", orjson.dumps({"type": "Hello", "id": 5, "role": "trainer", "name": "old", "token": "t"})]
        )
        assert sock.poll(5000)
        tag, head = sock.recv_multipart()
    finally:
        sock.close()
    reply = orjson.loads(head)
    assert tag == b"BB1", "the refusal goes back under the old peer's own tag, so it can read it"
    assert reply["type"] == "Error" and reply["id"] == 5 and reply["code"] == "BAD_REQUEST"
    assert "version 1 (b'BB1')" in reply["message"] and f"version 2 ({PROTOCOL!r})" in reply["message"]


# -- hostile frames: decoding never reads out of bounds ------------------------------------------

FIELDS = [Field("img", "uint8", (None, None, 3)), Field("t", "str", ()), Field("k", "int32", (2,))]
NAMES = [f.name for f in FIELDS]


def _good(n: int = 3):
    batch = {
        "img": [np.full((i + 1, 2, 3), i, np.uint8) for i in range(n)],
        "t": ["a", "bé", ""][:n],
        "k": np.arange(2 * n, dtype=np.int32).reshape(n, 2),
    }
    return encode_frames(FIELDS, batch, n)


@settings(max_examples=300, deadline=None)
@given(frame=st.integers(0, 4), pos=st.integers(0, 200), value=st.integers(-(2**63), 2**63 - 1), cut=st.booleans())
def test_frames_with_bad_offsets_or_shapes_are_refused_never_read_past(frame, pos, value, cut):
    frames, shapes, dtypes, _ = _good()
    raw = [bytearray(bytes(f)) for f in frames]
    target = raw[frame]
    if cut and target:
        del target[pos % len(target) :]
    elif len(target) >= 8:
        at = (pos % (len(target) // 8)) * 8
        target[at : at + 8] = value.to_bytes(8, "little", signed=True)
    try:
        out = decode_frames(NAMES, shapes, dtypes, [bytes(r) for r in raw])
    except BusError:
        return
    for img in out["img"]:  # whatever was accepted lies inside the values frame
        assert img.nbytes <= len(raw[0])
    # and the same bytes laid out in a ring slot
    buf = bytearray(4096)
    pos2 = 0
    for piece in (raw[1], raw[0], raw[3], raw[2], raw[4]):  # index before values in a slot
        buf[pos2 : pos2 + len(piece)] = piece
        pos2 = -(-(pos2 + len(piece)) // 64) * 64
    try:
        unpack_slot(NAMES, shapes, dtypes, memoryview(buf))
    except BusError:
        pass


@pytest.mark.parametrize(
    "shapes, dtypes, words",
    [
        ([[3, -1, -1, 3], [3], [3, 2]], ["|u1", "str", "<i4", "x"], "3 shapes, 4 dtypes"),
        ([[3, -1, -1, 3], [2], [3, 2]], ["|u1", "str", "<i4"], "sample counts"),
        ([[3, -1, -1, 3], [3], [3, 2]], ["|O", "str", "<i4"], "dtype"),
        ([[3, -1, -1, 3], [3], [3, -2]], ["|u1", "str", "<i4"], "shape"),
        ([[3, -1, -1, 3], [3], [3, 3]], ["|u1", "str", "<i4"], "'k' is 24 bytes; expected 36"),
    ],
)
def test_headers_that_do_not_match_the_frames_are_refused(shapes, dtypes, words):
    frames = _good()[0]
    with pytest.raises(BusError, match=words):
        decode_frames(NAMES, shapes, dtypes, frames)
    with pytest.raises(BusError, match="distinct strings"):
        decode_frames(["img", "t", "img"], _good()[1], _good()[2], frames)


def test_evaluating_a_multi_field_dataset_is_refused_clearly(fields_provider, make_token):
    identity = Identity(role="trainer", name="t", token=make_token())
    with Client(fields_provider.endpoint, identity) as client:
        with pytest.raises(
            BadRequest,
            match=r"'multi': field 'image' is uint8 of shape \[None, None, 3\]: the built-in models need .*resize.*or name an evaluator",
        ):
            client.request(Evaluate(dataset="multi", model={"name": "mlp"}, frames=[b"\0" * 8]))


@settings(max_examples=60, **FUZZ)
@given(batch=st.lists(batch_request(slot_seq=True), min_size=3, max_size=8))
def test_hostile_requests_for_a_multi_field_dataset_are_refused_or_exact(fields_provider, make_token, batch):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    token = make_token()
    admit_client(sock, token)
    source = fields_provider.service.handler.datasets["multi"]
    try:
        sock.connect(fields_provider.endpoint)
        hello = {"type": "Hello", "id": 1, "role": "trainer", "name": "fuzz", "token": token}
        sock.send_multipart([PROTOCOL, orjson.dumps(hello)])
        assert sock.poll(5000) and decode(sock.recv_multipart()).type == "Welcome"
        for frames in batch:
            head = orjson.loads(frames[1])
            head["dataset"] = "multi" if head["dataset"] in ("mnist", "zeros") else head["dataset"]
            sock.send_multipart([frames[0], orjson.dumps(head), *frames[2:]])
            assert sock.poll(5000), "the provider stopped answering"
            reply = decode(sock.recv_multipart())
            if reply.type == "Error":
                assert reply.code in {"BAD_REQUEST", "NOT_FOUND", "OUT_OF_RANGE", "TOO_LARGE", "SPLIT_PRIVATE"}, reply
                continue
            idx = np.arange(*head["range"]) if "range" in head else np.frombuffer(frames[2], "<i8")
            got = decode_frames(reply.names, reply.shapes, reply.dtypes, reply.frames)
            want = source.read_fields(head["split"], idx)
            assert got["text"] == want["text"] and got["label"].tobytes() == want["label"].tobytes()
            assert [a.tobytes() for a in got["image"]] == [a.tobytes() for a in want["image"]]
    finally:
        sock.close()


def test_an_empty_batch_round_trips_over_frames_and_a_slot(fields_provider, make_token):
    with Client(fields_provider.endpoint, Identity(role="trainer", name="t", token=make_token())) as client:
        reply = client.request(BatchRequest(dataset="multi", split="train", range=[3, 3]))
    assert reply.shapes == [[0, -1, -1, 3], [0, -1], [0], [0]]
    got = decode_frames(reply.names, reply.shapes, reply.dtypes, reply.frames)
    assert got["image"] == [] and got["text"] == [] and got["label"].shape == (0,)
    fields = open_source(URI).fields
    slot = memoryview(bytearray(slot_bytes_for(fields, 4)))
    shapes, dtypes, _ = pack_slot(fields, open_source(URI).read_fields("train", np.arange(0)), 0, slot)
    assert unpack_slot(reply.names, shapes, dtypes, slot)["tokens"] == []


def test_a_sample_shape_whose_product_overflows_int64_is_refused():
    # 2^32 × 2^32 × 3 bytes is 0 modulo 2^64: an int64 check alone would take it for an empty sample
    index = np.array([0, 0, 2**32, 2**32, 3], "<i8").tobytes()
    with pytest.raises(BusError, match=r"sample of shape \[4294967296, 4294967296, 3\] spans 0 bytes"):
        decode_frames(["img"], [[1, -1, -1, 3]], ["|u1"], [b"", index])


def test_a_dataset_with_more_fields_than_a_message_carries_is_refused_at_start(tmp_path):
    pq.write_table(pa.table({f"t{i}": pa.array(["a", "b"]) for i in range(8)}), tmp_path / "train.parquet")
    source = open_source(f"parquet://{tmp_path}?val_fraction=0&fields=" + ",".join(f"t{i}" for i in range(8)))
    with pytest.raises(ConfigError, match="8 fields, whose batches need 16 frames; a message carries at most 14"):
        ProviderHandler({"wide": source})
