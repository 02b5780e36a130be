"""A loader over a record range of a split (``RemoteLoader(samples=(start, stop))``, a job's
``train_range``): every epoch reads each sample of the range exactly once and none outside it,
shards split the range, and a cursor resumes inside it exactly (and is refused on another range)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from libbus import RemoteLoader
from libbus.errors import BadRequest, OutOfRange

N = 48


@pytest.fixture
def ids(start_provider, tmp_path_factory):
    """Train sample i holds i in its first feature."""
    d = tmp_path_factory.mktemp("ids")
    for split, n in (("train", N), ("val", 6), ("test", 5)):
        i = np.arange(n)
        np.save(d / f"{split}_x.npy", np.stack([i, i % 3], axis=1).astype(np.float32))
        np.save(d / f"{split}_y.npy", (i % 2).astype(np.int64))
    return start_provider(f"ids=file://{d}")


def _loader(ids, make_token, **kw) -> RemoteLoader:
    kw.setdefault("batch_size", 5)
    return RemoteLoader("ids", provider=ids.endpoint, token=make_token("trainer"), seed=3, **kw)


def _ids(batches) -> list[int]:
    return [int(v) for x, _ in batches for v in x[:, 0]]


def test_each_epoch_reads_the_range_once_in_a_shuffled_order(ids, make_token):
    with _loader(ids, make_token, samples=(10, 33), shuffle=True) as loader:
        assert len(loader.dataset) == 23 and len(loader) == 5
        first, second = _ids(loader), _ids(loader)
    assert sorted(first) == sorted(second) == list(range(10, 33))
    assert first != second  # a new permutation of the range each epoch


def test_two_ranks_split_the_range_and_resume_inside_it(ids, make_token):
    seen: Counter = Counter()
    for rank in (0, 1):
        with _loader(ids, make_token, samples=range(8, 40), shuffle=True, rank=rank, world_size=2) as loader:
            seen.update(_ids(loader))
    assert seen == Counter(range(8, 40))
    with _loader(ids, make_token, samples=(8, 40), shuffle=True) as whole:
        it = iter(whole)
        head = _ids([next(it), next(it)])
        state = whole.state_dict()
    with _loader(ids, make_token, samples=(8, 40), shuffle=True) as resumed:
        resumed.load_state_dict(state)
        tail = _ids(resumed)
    assert sorted(head + tail) == list(range(8, 40))
    with _loader(ids, make_token, samples=(9, 41), shuffle=True) as other:
        with pytest.raises(BadRequest, match="reading from sample 8 of the split, this loader reads from sample 9"):
            other.load_state_dict(state)


def test_a_range_past_the_split_or_empty_is_refused(ids, make_token):
    with pytest.raises(OutOfRange, match=r"samples \[40, 49\) are past the train split of 'ids': it has 48"):
        _loader(ids, make_token, samples=(40, 49))
    for bad in ((5, 5), (-1, 3), (3,), "0:4", range(0, 10, 2)):
        with pytest.raises(BadRequest, match="samples must be"):
            _loader(ids, make_token, samples=bad)
