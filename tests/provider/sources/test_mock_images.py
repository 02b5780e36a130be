"""``mock://mnist`` and ``mock://cifar10``: generated a batch at a time, the same bytes for a sample
whichever batch asks for it, and learnable (a class's samples share its pattern)."""

import numpy as np
import pytest

from services.provider.sources import open_source


@pytest.mark.parametrize("name", ["mnist", "cifar10"])
def test_a_sample_is_the_same_whichever_batch_asks_for_it(name):
    source = open_source(f"mock://{name}?n=500")
    whole, labels = source.read("train", np.arange(500))  # many chunks of the generator
    picked = np.array([499, 3, 77, 3, 250])
    x, y = source.read("train", picked)
    assert np.array_equal(x, whole[picked]) and np.array_equal(y, labels[picked])
    for i in (0, 31, 32, 33, 499):  # each alone, across the generator's chunk edges
        assert np.array_equal(source.read("train", np.array([i]))[0][0], whole[i])
    again, _ = open_source(f"mock://{name}?n=500").read("train", np.arange(500))
    assert np.array_equal(again, whole)  # a fresh source from the URI: the same bytes
    assert x.dtype == np.float32 and x.shape[1:] == source.sample_shape
    assert not np.array_equal(source.read("val", np.arange(5))[0], whole[:5])  # splits differ
    assert not np.array_equal(open_source(f"mock://{name}?n=500&seed=1").read("train", np.arange(5))[0], whole[:5])


@pytest.mark.parametrize("name", ["mnist", "cifar10"])
def test_classes_are_learnable_and_labels_balanced(name):
    source = open_source(f"mock://{name}?n=3000")
    x, y = source.read("train", np.arange(3000))
    tx, ty = source.read("val", np.arange(600))
    assert np.bincount(y, minlength=10).min() > 3000 / 10 / 2
    # the nearest class mean of the training samples names the class of nearly every held-out sample
    means = np.stack([x[y == c].reshape(-1, x[0].size).mean(0) for c in range(10)])
    flat = tx.reshape(len(tx), -1)
    predicted = np.argmax(flat @ means.T - 0.5 * (means**2).sum(1), axis=1)
    assert (predicted == ty).mean() > 0.95
    # and the noise is what the URI says: centred, its standard deviation about `noise`
    quiet, _ = open_source(f"mock://{name}?n=3000&noise=0.5").read("train", np.arange(200))
    assert abs(float(x.mean())) < 0.1 and 2.0 < float(x.std()) < 2.5 and float(quiet.std()) < 1.5
