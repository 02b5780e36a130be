"""The provider on real sockets: data by index and range, the private split, range checks,
malformed frames that leave it serving, and evaluation of safetensors weights on its test split."""

import contextlib
import sys

import numpy as np
import orjson
import pytest
import torch
from safetensors.torch import save as save_safetensors

from libbus import PROTOCOL
from libbus.errors import BadRequest, BusError, NotFound, OutOfRange, SplitPrivate, TooLarge
from libbus.loader.remote import RemoteLoader
from libbus.wire.messages import BatchRequest, DatasetInfoRequest, Evaluate, decode, encode
from services.models import build_model
from services.provider.sources import open_source

MNIST = "mock://mnist?n=600"


def indices_frame(idx) -> bytes:
    return np.asarray(idx, dtype="<i8").tobytes()


def arrays(reply):
    x = np.frombuffer(reply.frames[0].buffer, reply.dtypes[0]).reshape(reply.shapes[0])
    y = np.frombuffer(reply.frames[1].buffer, reply.dtypes[1]).reshape(reply.shapes[1])
    return x, y


def test_dataset_info_describes_splits_and_keeps_test_private(provider, client_for):
    info = client_for(provider.endpoint).request(DatasetInfoRequest(dataset="mnist")).info
    assert info["splits"]["train"] == {"num_samples": 600, "available": True, "shuffle": True}
    assert info["splits"]["test"]["available"] is False
    assert info["sample_shape"] == [1, 28, 28] and info["num_classes"] == 10 and info["dtype"] == "float32"


def test_batches_by_indices_and_by_range_are_the_source_bytes(provider, client_for):
    client = client_for(provider.endpoint)
    source = open_source(MNIST)
    idx = [5, 0, 599, 17, 17]
    x, y = arrays(client.request(BatchRequest(dataset="mnist", split="train", frames=[indices_frame(idx)])))
    want_x, want_y = source.read("train", np.array(idx))
    assert np.array_equal(x, want_x) and np.array_equal(y, want_y)
    x, y = arrays(client.request(BatchRequest(dataset="mnist", split="val", range=[10, 42])))
    want_x, want_y = source.read("val", np.arange(10, 42))
    assert x.shape == (32, 1, 28, 28) and np.array_equal(x, want_x) and np.array_equal(y, want_y)


def test_the_test_split_never_leaves_the_provider(provider, client_for):
    for role in ("trainer", "admin"):
        with pytest.raises(SplitPrivate):
            client_for(provider.endpoint, role=role).request(BatchRequest(dataset="mnist", split="test", range=[0, 1]))
    assert provider.service.handler.refused["split_private"] == 2


@pytest.mark.parametrize(
    "request_kw, error",
    [
        (dict(range=[0, 601]), OutOfRange),
        (dict(range=[-1, 3]), OutOfRange),
        (dict(frames=[indices_frame([0, 600])]), OutOfRange),
        (dict(frames=[indices_frame([3, -2])]), OutOfRange),
        (dict(range=[5, 2]), BadRequest),
        (dict(frames=[b"1234567"]), BadRequest),
        (dict(), BadRequest),
        (dict(range=[0, 1], frames=[indices_frame([0])]), BadRequest),
        (dict(range=[0, 2_000_000]), TooLarge),
        (dict(split="bogus", range=[0, 1]), BadRequest),
        (dict(dataset="nope", range=[0, 1]), NotFound),
    ],
)
def test_bad_batch_requests_get_their_error(provider, client_for, request_kw, error):
    kw = {"dataset": "mnist", "split": "train", **request_kw}
    with pytest.raises(error):
        client_for(provider.endpoint).request(BatchRequest(**kw))


@pytest.mark.parametrize(
    "indices, header_range",
    [
        ([4, 5, 6, 7], [4, 8]),  # a run up by one: the header says it all
        ([9], [9, 10]),
        ([3, 1, 2], None),
        ([5, 5, 6], None),
        ([7, 6, 5], None),
        ([0, 2, 4], None),
        ([], None),
    ],
)
def test_indices_travel_as_a_range_or_one_int64_frame_and_read_back_the_same(indices, header_range):
    """The indices' wire rule, written once beside BatchRequest: what the loader encodes, the provider
    reads back exactly, after the message went through encode and decode."""
    idx = np.asarray(indices, dtype=np.int64)
    sent = BatchRequest.for_indices(idx, dataset="d", split="train", epoch=3, slot=1, seq=9)
    assert sent.range == header_range and len(sent.frames) == (header_range is None)
    got = decode(encode(sent))
    assert (got.dataset, got.split, got.epoch, got.slot, got.seq) == ("d", "train", 3, 1, 9)
    assert got.indices(10).tolist() == indices
    with pytest.raises(OutOfRange, match="outside train") if indices else contextlib.nullcontext():
        got.indices(max(indices, default=0))  # the split one sample too small


class Path:
    """A provider's source, recording at each read the functions a request crossed to reach it,
    from the handler's ``batch`` on (as the issue that laid the path out counts them)."""

    def __init__(self, source):
        self.source, self.paths = source, []

    def __getattr__(self, name):
        return getattr(self.source, name)

    def _record(self, read: str) -> None:
        names, frame = [read], sys._getframe(2)
        while frame is not None and names[-1] not in ("batch", "_worker"):  # the loop's walk, or a lane thread's
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        self.paths.append(names[::-1])

    def serve_into(self, split, indices, x, y, *, epoch=0):
        self._record("serve_into")
        self.source.serve_into(split, indices, x, y, epoch=epoch)

    def read_fields(self, split, indices, epoch=0):
        self._record("read_fields")
        return self.source.read_fields(split, indices, epoch)


@pytest.mark.parametrize("shm", [True, False])
@pytest.mark.parametrize("dataset", ["mnist", "multi"])
def test_a_batch_request_crosses_four_functions_to_the_source_read(start_provider, make_token, shm, dataset):
    """docs/architecture.md, "One BatchRequest, function by function": the same walk on both
    transports and in both payload forms (x/y, named fields)."""
    provider = start_provider("mnist=mock://mnist?n=64", "multi=mock://fields?n=50")
    handler = provider.service.handler
    path = handler.datasets[dataset] = Path(handler.datasets[dataset])
    with RemoteLoader(dataset, provider=provider.endpoint, token=make_token(), batch_size=5, shm=shm) as loader:
        assert sum(1 for _ in loader) == (10 if dataset == "multi" else 13)
        assert loader.transport == ("shm" if shm else "socket")
    read = "serve_into" if dataset == "mnist" else "read_fields"
    # generated data is read on a lane off the loop (services/provider/fillers.py): that thread's walk
    # starts at its worker, then the same two steps
    walks = (["batch", "run", "write_batch", read], ["_worker", "run", "write_batch", read])
    assert path.paths and all(p in walks for p in path.paths), path.paths


def test_malformed_frames_get_errors_and_the_provider_keeps_serving(provider, client_for, raw_dealer, make_token):
    client = client_for(provider.endpoint)
    client.hello()
    sock = client.socket  # an authenticated connection, fed garbage
    junk = [
        [b"\x00\xff garbage"],
        [PROTOCOL, b"{bad json"],
        [PROTOCOL, orjson.dumps({"type": "Launch", "id": 1})],
        [PROTOCOL, orjson.dumps({"type": "BatchRequest", "id": 2})],
        [PROTOCOL, orjson.dumps({"type": "BatchRequest", "id": 3, "dataset": 5, "split": "train"})],
        [PROTOCOL, orjson.dumps({"type": "Welcome", "id": 4, "session": "x", "heartbeat_ms": 1})],
        [b"XXX", b"{}"],
    ]
    for frames in junk:
        sock.send_multipart(frames)
    codes = []
    for _ in junk:
        assert sock.poll(3000), "no reply to a malformed message"
        codes.append(decode(sock.recv_multipart()).code)
    assert codes == ["BAD_REQUEST"] * len(junk)
    # oversize: a frame beyond MAXMSGSIZE makes libzmq drop that connection, not the service
    big = raw_dealer(provider.endpoint)
    big.send_multipart([PROTOCOL, b"{}", b"\0" * (provider.settings.max_msg_bytes + 1)])
    x, _ = arrays(client.request(BatchRequest(dataset="mnist", split="train", range=[0, 4])))
    assert x.shape == (4, 1, 28, 28)
    counters = provider.service.server.counters
    assert counters["malformed"] == len(junk) - 1 and counters["error_BAD_REQUEST"] >= 1  # Welcome parses


def _weights(model) -> bytes:
    return save_safetensors({k: v.contiguous() for k, v in model.state_dict().items()})


def test_evaluate_scores_weights_on_the_private_split(provider, client_for):
    info = client_for(provider.endpoint).request(DatasetInfoRequest(dataset="mnist")).info
    torch.manual_seed(0)
    model = build_model("mlp", info)
    reply = client_for(provider.endpoint, timeout_s=60).request(
        Evaluate(dataset="mnist", model={"name": "mlp", "kwargs": {}}, frames=[_weights(model)])
    )
    assert reply.n == 120 and 0.0 <= reply.accuracy <= 1.0 and reply.loss > 0
    # the same weights scored here, on the same data, give the same numbers
    x, y = open_source(MNIST).read("test", np.arange(120))
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
    assert reply.accuracy == pytest.approx((logits.argmax(1) == torch.from_numpy(y)).float().mean().item())


def test_evaluate_refuses_pickles_and_mismatched_weights(provider, client_for):
    import pickle

    client = client_for(provider.endpoint, timeout_s=30)
    evil = pickle.dumps({"w": torch.zeros(3)})
    with pytest.raises(BadRequest, match="safetensors"):
        client.request(Evaluate(dataset="mnist", model={"name": "mlp", "kwargs": {}}, frames=[evil]))
    wrong = _weights(torch.nn.Linear(3, 2))
    with pytest.raises(BadRequest, match="do not fit"):
        client.request(Evaluate(dataset="mnist", model={"name": "mlp", "kwargs": {}}, frames=[wrong]))
    with pytest.raises(BusError, match="built-in models only"):
        client.request(Evaluate(dataset="mnist", model={"name": "resnet9000"}, frames=[wrong]))


def test_evaluate_sizes_the_model_from_the_weights_not_from_the_peers_kwargs(provider, client_for):
    """68 bytes of kwargs must not make the provider build a 31 GB model: the model's shape is
    built on the meta device and refused when the weights sent cannot fill it; the provider goes on serving."""
    client = client_for(provider.endpoint, timeout_s=30)
    small = _weights(build_model("mlp", {"sample_shape": [1, 28, 28], "num_classes": 10}))
    with pytest.raises(BadRequest, match=r"do not fit model 'mlp': with kwargs \{'hidden': 10000000\} it needs"):
        client.request(Evaluate(dataset="mnist", model={"name": "mlp", "kwargs": {"hidden": 10**7}}, frames=[small]))
    reply = client.request(Evaluate(dataset="mnist", model={"name": "mlp", "kwargs": {}}, frames=[small]))
    assert reply.n == 120


def test_evaluate_never_imports_code_named_by_a_peer(provider, client_for):
    from libbus.errors import Forbidden

    with pytest.raises(Forbidden, match="built-in models only"):
        client_for(provider.endpoint, timeout_s=10).request(
            Evaluate(dataset="mnist", model={"name": "os:system", "kwargs": {}}, frames=[b"x"])
        )
