"""A pipeline's batches are read off the provider's loop, several at once (services/provider/fillers.py
``overlap``): the next batch's chunks go through the first stages while the last ones finish the batch
before. What a loader must still see: the same bytes, in order, errors as errors, rings unmapped only
once nothing writes into them."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from libbus.errors import BadRequest, DatasetError
from libbus.loader.remote import RemoteLoader
from libbus.order.epochs import batches_of, epoch_order
from services.provider.fillers import RingUse
from services.provider.sources.base import ReadPolicy
from shm import Ring, RingLayout
from tests.support.images import write_imagefolder

PIPELINE = """
seed = 3
chunk = 16
[[stages]]
name = "digits"
source = { uri = "mock://mnist?n=256&noise=1" }
[[stages]]
name = "crop"
input = "digits"
random_crop = { padding = 2 }
[[stages]]
name = "flip"
input = "crop"
flip = { p = 0.5 }
"""


class Watch:
    """The pipeline, recording how many of its reads ran at once and on which threads (and failing one
    on demand); everything else is the pipeline's own."""

    def __init__(self, source, fail_at: int = -1):
        self.source, self.fail_at = source, fail_at
        self.lock = threading.Lock()
        self.running = self.most = self.reads = 0
        self.threads: set[str] = set()

    def __getattr__(self, name):
        return getattr(self.source, name)

    def serve_into(self, split, indices, x, y, *, epoch=0):
        return self._watched(lambda: self.source.serve_into(split, indices, x, y, epoch=epoch))

    def read_fields(self, split, indices, epoch=0):
        return self._watched(lambda: self.source.read_fields(split, indices, epoch))

    def _watched(self, read):
        with self.lock:
            self.reads += 1
            failing = self.reads - 1 == self.fail_at
            self.running += 1
            self.most = max(self.most, self.running)
            self.threads.add(threading.current_thread().name)
        try:
            time.sleep(0.02)  # a read waits on the stages' threads; long enough for the next to start
            if failing:
                raise DatasetError("stage 'crop' (random_crop): the test's planted failure")
            return read()
        finally:
            with self.lock:
                self.running -= 1


NAMED = """
[[stages]]
name = "src"
source = {{ uri = "{uri}" }}
[[stages]]
name = "crop"
input = "src"
field = "image"
random_resized_crop = {{ size = 10 }}
[[stages]]
name = "flip"
input = "crop"
field = "image"
flip = {{ p = 0.5 }}
"""


@pytest.fixture
def provider(start_provider, tmp_path):
    path = tmp_path / "aug.toml"
    path.write_text(PIPELINE)
    return start_provider(f"aug=pipeline://{path}")


@pytest.mark.parametrize("shm", [True, False])
def test_batches_are_read_several_at_once_off_the_loop_with_the_bytes_of_one_at_a_time(provider, make_token, shm):
    handler = provider.service.handler
    pipeline = handler.datasets["aug"]
    assert pipeline.read_policy is ReadPolicy.OVERLAP
    watch = handler.datasets["aug"] = Watch(pipeline)
    with RemoteLoader(
        "aug", provider=provider.endpoint, token=make_token(), batch_size=32, seed=5, inflight=4, shm=shm
    ) as loader:
        assert loader.transport == ("shm" if shm else "socket")
        got = [(x.clone(), y.clone()) for x, y in loader]
    # the 8 batches, and at most inflight - 1 of the next epoch asked ahead after the whole pass
    assert len(got) == 8 and 8 <= watch.reads <= 8 + loader.inflight - 1
    assert watch.most >= 2, "the pipeline's batches were read one at a time"
    assert all(name.startswith("overlap") for name in watch.threads), watch.threads
    # the bytes of reading each batch alone, in the loader's order (epoch 0)
    want = batches_of(epoch_order(256, epoch=0, seed=5, shuffle=True), 32, False)
    for (x, y), indices in zip(got, want):
        wx = np.empty(tuple(x.shape), np.float32)
        wy = np.empty(tuple(y.shape), np.int64)
        pipeline.serve_into("train", np.asarray(indices), wx, wy, epoch=0)
        assert torch.equal(x, torch.from_numpy(wx)) and torch.equal(y, torch.from_numpy(wy))


@pytest.mark.parametrize("shm", [True, False])
def test_named_fields_are_read_off_the_loop_too(start_provider, make_token, tmp_path, shm):
    """An image folder as named fields, cropped and flipped (``field = "image"``): its batches overlap too."""
    folder = write_imagefolder(tmp_path / "imgs", per_class=8)
    path = tmp_path / "named.toml"
    path.write_text(NAMED.format(uri=f"file://{folder}?fields=image,label&val_fraction=0"))
    provider = start_provider(f"aug=pipeline://{path}")
    handler = provider.service.handler
    pipeline = handler.datasets["aug"]
    watch = handler.datasets["aug"] = Watch(pipeline)
    with RemoteLoader(
        "aug", provider=provider.endpoint, token=make_token(), batch_size=4, shuffle=False, inflight=4, shm=shm
    ) as loader:
        loader.set_epoch(2)
        got = [{k: v.clone() for k, v in batch.items()} for batch in loader]
    assert loader.transport == ("shm" if shm else "socket") and len(got) == 4
    assert watch.most >= 2 and all(name.startswith("overlap") for name in watch.threads), watch.threads
    for n, batch in enumerate(got):
        want = pipeline.read_fields("train", np.arange(4 * n, 4 * n + 4), 2)
        assert np.array_equal(batch["image"].numpy(), want["image"])
        assert np.array_equal(batch["label"].numpy(), want["label"])


def test_a_failed_read_reaches_the_loader_and_the_provider_serves_on(provider, make_token):
    handler = provider.service.handler
    handler.datasets["aug"] = Watch(handler.datasets["aug"], fail_at=2)
    with RemoteLoader("aug", provider=provider.endpoint, token=make_token(), batch_size=32, inflight=4) as loader:
        with pytest.raises(BadRequest, match="planted failure"):  # a DatasetError, code BAD_REQUEST
            for _ in loader:
                pass
        # the provider serves on, and the next pass is a whole one, as with DataLoader: a pass that ended in an
        # error leaves no trace: the next iter() is the next epoch, all 8 of its batches
        assert sum(1 for _ in loader) == 8 and loader.epoch == 2  # epochs 0 (failed) and 1 (whole) are done


def test_a_ring_is_unmapped_only_once_its_last_fill_has_ended():
    ring = Ring.create(RingLayout(2, 4096, 2048))
    try:
        use = RingUse()
        use.hold(ring)
        use.hold(ring)  # two batches of one session in flight
        use.close(ring)  # its session closed meanwhile
        assert ring.slot_buffer(0) is not None  # still mapped: fills write into it
        use.release(ring)
        assert ring.slot_buffer(1) is not None
        use.release(ring)  # the last one ended
        with pytest.raises(Exception, match="closed"):
            ring.slot_buffer(0)
        other = Ring.create(RingLayout(2, 4096, 2048))
        use.close(other)  # nothing in flight: at once
        with pytest.raises(Exception, match="closed"):
            other.slot_buffer(0)
    finally:
        ring.close()
