"""The stall split names the slow part whatever the source: time a provider spends producing a batch
(generating, reading, decoding, a stage) is ``read`` or that stage, never ``transfer``.

One contract, run against every source kind, each given one deliberately slow part that is long
against everything else the batch goes through (a server's sleep per request, decoding large images
into tiny ones, generating large batches): the loader reads a pass as fast as it can (so it waits on
the provider) and the split must name that part as the largest share. No duration is asserted."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from libbus.loader.remote import RemoteLoader
from tests.support.httpd import RangeServer
from tests.support.images import image_bytes
from tests.support.s3server import s3_in_env

ALLOWED = ["tests.support.user_transforms"]
#: Seconds every HTTP or object-store request sleeps before its answer: a far bucket.
DELAY_S = 0.05


@dataclass
class Case:
    """A dataset URI with one slow part, the part the split must name, and the loader's batch size."""

    uri: str
    slow: str
    batch_size: int = 8
    #: Seconds the source's own read sleeps per batch (a generator slow by construction), or 0.
    read_s: float = 0.0


class SlowReads:
    """A provider's source whose every batch read takes ``seconds`` more, inside the read."""

    def __init__(self, source, seconds: float):
        self.source, self.seconds = source, seconds

    def __getattr__(self, name):
        return getattr(self.source, name)

    def serve_into(self, split, indices, x, y, *, epoch=0):
        time.sleep(self.seconds)
        self.source.serve_into(split, indices, x, y, epoch=epoch)


def _tokens(folder: Path) -> None:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(2):
        (folder / f"shard-{i:02d}.bin").write_bytes(rng.integers(0, 60000, 16 * 40).astype("<u2").tobytes())


@contextmanager
def mock_case(tmp_path: Path) -> Iterator[Case]:
    # generating is the slow part, against a reply of a few hundred bytes through the ring: 256 CIFAR-shaped
    # samples a batch, each batch's generation made 50 ms longer (generating alone, a millisecond or two,
    # is not longer than a loaded machine's hand-offs)
    yield Case("mock://cifar10?n=4096", "read", batch_size=256, read_s=DELAY_S)


@contextmanager
def file_case(tmp_path: Path) -> Iterator[Case]:
    # 512x512 PNGs decoded and resized to 8x8 on the provider: decoding is the slow part
    for label in range(2):
        folder = tmp_path / "pics" / "train" / f"class{label}"
        folder.mkdir(parents=True)
        for n in range(32):
            (folder / f"{n}.png").write_bytes(image_bytes(label, n, "PNG", size=(512, 512)))
    yield Case(f"file://{tmp_path / 'pics'}?size=8&workers=1", "read", batch_size=4)


@contextmanager
def http_case(tmp_path: Path) -> Iterator[Case]:
    _tokens(tmp_path / "tok")
    server = RangeServer(tmp_path)
    try:
        server.delay_s = DELAY_S
        yield Case(f"{server.url}/tok/shard-{{00..01}}.bin?seq_len=15&token_bytes=2&retries=2&timeout=5", "read")
    finally:
        server.close()


@contextmanager
def object_store_case(tmp_path: Path) -> Iterator[Case]:
    with s3_in_env() as s3:
        _tokens(tmp_path / "tok")
        s3.put_dir("data", "tok", tmp_path / "tok")
        s3.delay_s = DELAY_S
        yield Case("s3://data/tok/?seq_len=15&token_bytes=2&retries=2&backoff=0.01&deadline=20", "read")


@contextmanager
def pipeline_case(tmp_path: Path) -> Iterator[Case]:
    path = tmp_path / "slow.toml"
    path.write_text(
        textwrap.dedent("""
        [[stages]]
        name = "images"
        source = { uri = "mock://cifar10?n=96" }

        [[stages]]
        name = "augment"
        input = "images"
        user = { function = "tests.support.user_transforms:slow" }
        """)
    )
    yield Case(f"pipeline://{path}", "stage:augment")


KINDS: dict[str, Callable[[Path], contextmanager]] = {
    "mock": mock_case,
    "file": file_case,
    "http": http_case,
    "object-store": object_store_case,
    "pipeline": pipeline_case,
}


CASES = [
    # generating is the slow part only against a ring's small reply: over a socket the batch's bytes
    # cost about what generating them does
    pytest.param("mock", True, id="mock-ring"),
    *(pytest.param("file", shm, id=f"file-{way}") for shm, way in ((True, "ring"), (False, "socket"))),
    *(
        pytest.param(kind, shm, id=f"{kind}-{way}")
        for kind in ("http", "object-store", "pipeline")
        for shm, way in ((True, "ring"), (False, "socket"))
    ),
]


@pytest.mark.parametrize("kind, shm", CASES)
def test_the_slow_part_of_every_source_kind_is_the_largest_share(kind, shm, tmp_path, start_provider, make_token):
    with KINDS[kind](tmp_path) as case:
        provider = start_provider(f"d={case.uri}", user_modules=ALLOWED)
        if case.read_s:
            handler = provider.service.handler
            handler.datasets["d"] = SlowReads(handler.datasets["d"], case.read_s)
        with RemoteLoader(
            "d", provider=provider.endpoint, token=make_token(), batch_size=case.batch_size, shm=shm, shuffle=False
        ) as loader:
            assert loader.transport == ("shm" if shm else "socket")
            assert sum(1 for _ in loader) >= 3
            split = loader.stall.breakdown()
    parts = split["parts"]
    assert split["largest"] == case.slow, split
    assert parts[case.slow] > sum(v for k, v in parts.items() if k != case.slow), split
