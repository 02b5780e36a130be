"""A job trains the ``mlp`` on MNIST-layout IDX files (uint8 images, the
real byte layout) through router, provider and trainer, to the accuracy such data allows."""

import struct
from pathlib import Path

import numpy as np
import torch

from libbus.wire.messages import DatasetInfoRequest, SubmitJob
from services.models import as_float, predictions
from services.provider.sources import open_source
from tests.support import wait_job

#: Learnable MNIST-shaped images: class blobs (std 1), shifted and scaled, under pixel noise of std 1.
MOCK = "mock://mnist?n=3000&noise=1"


def write_idx(path: Path, a: np.ndarray) -> None:
    """An IDX file as MNIST ships it: magic ``0 0 0x08 ndim``, big-endian uint32 dims, then the bytes."""
    if a.dtype != np.uint8:
        raise TypeError(f"write_idx writes unsigned bytes (0x08), got {a.dtype}")
    path.write_bytes(struct.pack(">BBBB", 0, 0, 0x08, a.ndim) + struct.pack(f">{a.ndim}I", *a.shape) + a.tobytes())


def to_uint8(x: np.ndarray) -> np.ndarray:
    """Float images onto 0..255 as an image file stores them: [-4, 4] in 256 levels, so that a class
    pattern spans much of the byte range as MNIST strokes do (step 0.03 against noise of std 1: the
    quantization costs nothing; the few values beyond ±4 saturate, as bright pixels do).

    Contrast matters: models read ``uint8 / 255`` unnormalized, and the same patterns squeezed into
    a tenth of the range (noise 3 over [-10, 10]) leave an mlp near chance after 2 epochs."""
    return np.clip(np.rint((x + 4.0) * (255 / 8.0)), 0, 255).astype(np.uint8)


def nearest_mean_accuracy(x: np.ndarray, y: np.ndarray, tx: np.ndarray, ty: np.ndarray) -> float:
    """Accuracy on ``tx`` of the nearest-class-mean rule fitted on ``x``: under isotropic Gaussian noise
    around a class pattern it is the optimal rule, so it measures what this data allows a classifier."""
    train, test = (a.reshape(len(a), -1).astype(np.float64) for a in (x, tx))
    means = np.stack([train[y == c].mean(0) for c in range(10)])
    dist = (test**2).sum(1)[:, None] - 2 * test @ means.T + (means**2).sum(1)[None]
    return float((dist.argmin(1) == ty).mean())


def test_a_job_trains_the_mlp_on_idx_files_to_the_accuracy_the_data_allows(
    tmp_path, router, start_provider, trainer, client_for, make_token
):  # noqa: F811 - pytest fixture
    source = open_source(MOCK)
    x, y = source.read("train", np.arange(source.num_samples("train")))
    tx, ty = source.read("test", np.arange(source.num_samples("test")))
    x, tx = to_uint8(x[:, 0]), to_uint8(tx[:, 0])  # (N, 28, 28) uint8, as in train-images-idx3-ubyte
    data = tmp_path / "mnist"
    data.mkdir()
    write_idx(data / "train-images-idx3-ubyte", x)
    write_idx(data / "train-labels-idx1-ubyte", y.astype(np.uint8))
    write_idx(data / "t10k-images-idx3-ubyte", tx)
    write_idx(data / "t10k-labels-idx1-ubyte", ty.astype(np.uint8))
    # The file source carves val from the tail of train (val_fraction 0.1): fit the reference on the rest.
    n_val = len(x) // 10
    allows = nearest_mean_accuracy(x[:-n_val], y[:-n_val], tx, ty)
    assert allows > 0.9, f"the generated data should be learnable; nearest-mean scores {allows:.3f}"

    provider = start_provider(f"digits=file://{data}", assigned_only=True)
    admin = client_for(router.endpoint, role="admin")
    # a dataset-scoped token: this provider serves unscoped trainers only their job's dataset
    info = (
        client_for(provider.endpoint, token=make_token(datasets=["digits"]))
        .request(DatasetInfoRequest(dataset="digits"))
        .info
    )
    assert (info["format"], info["dtype"], info["sample_shape"]) == ("idx", "uint8", [1, 28, 28])
    assert {s: v["num_samples"] for s, v in info["splits"].items()} == {"train": 2700, "val": 300, "test": 600}

    job = admin.request(
        SubmitJob(
            spec={
                "dataset": "digits",
                "model": "mlp",
                "epochs": 2,
                "batch_size": 32,
                "lr": 1e-3,
                "seed": 0,
                "shuffle": "block",
                "block_size": 256,
            }
        )
    ).job
    done = wait_job(admin, job, timeout=60)
    assert done["state"] == "succeeded", done.get("error")
    assert (done["spec"]["shuffle"], done["spec"]["block_size"]) == ("block", 256)
    result = done["result"]
    print(
        f"mlp on uint8 IDX {MOCK}: nearest-mean {allows:.4f}, val acc {result['val_accuracy']:.4f}, "
        f"provider-side test acc {result['test_accuracy']:.4f} (n={result['test_n']}), "
        f"val losses {[round(e['val_loss'], 3) for e in result['history']]}"
    )
    # Within 3 points of the near-optimal rule, on val (300 samples) and on the provider's private
    # test split (600): at 0.99 a binomial std on 300 samples is 0.6 points. Chance is 0.1.
    assert result["val_accuracy"] >= allows - 0.03
    assert result["test_n"] == 600 and result["test_accuracy"] >= allows - 0.03
    assert provider.service.handler.served["digits"]["evaluations"] == 1


def test_integer_images_reach_the_model_as_float():
    """uint8 is scaled to [0, 1] as torchvision's ToTensor does; other integers keep their values;
    float batches are passed on untouched (no copy)."""
    x = torch.arange(256, dtype=torch.int64).reshape(4, 1, 8, 8)
    model = torch.nn.Flatten()
    seen, _ = predictions(model, x.to(torch.uint8), torch.zeros(4), "image")
    assert seen.dtype == torch.float32 and torch.equal(seen, x.reshape(4, -1).float() / 255)
    assert seen.min() == 0 and seen.max() == 1
    assert torch.equal(as_float(x.to(torch.int16)), x.float())
    f = torch.randn(2, 3)
    assert as_float(f) is f
