"""The same samples, written by each peer loader's own writer (TFRecord,
MosaicML Streaming's MDS, litData's optimize(), Hugging Face's save_to_disk), are served by a provider as
written and train a job through router, provider and trainer to the accuracy the same data in ``.npy``
trains to."""

import numpy as np
import pytest

from libbus.wire.messages import DatasetInfoRequest, SubmitJob
from services.provider.sources import open_source
from tests.support import wait_job
from tests.support.peers import write_xy_everywhere

FORMATS = ["npy", "tfrecord", "mds", "litdata", "hf"]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    source = open_source("mock://mnist?n=600&noise=1")
    x, y = source.read("train", np.arange(source.num_samples("train")))
    source.close()
    d = tmp_path_factory.mktemp("peers")
    return d, write_xy_everywhere(d, x, y)


def test_each_peer_format_trains_a_job_to_the_accuracy_of_npy(written, router, start_provider, trainer, client_for):
    d, queries = written
    formats = {"npy": "npy", "tfrecord": "tfrecord", "mds": "mds", "litdata": "litdata", "hf": "hf-disk"}
    provider = start_provider(*(f"{name}=file://{d / name}?{queries[name]}" for name in FORMATS))
    client = client_for(provider.endpoint)
    admin = client_for(router.endpoint, role="admin")
    accuracy = {}
    for name in FORMATS:
        info = client.request(DatasetInfoRequest(dataset=name)).info
        assert (info["format"], info["sample_shape"], info["num_classes"]) == (formats[name], [1, 28, 28], 10)
        spec = {"dataset": name, "model": "mlp", "epochs": 2, "batch_size": 32, "lr": 3e-3, "seed": 0}
        done = wait_job(admin, admin.request(SubmitJob(spec=spec)).job, timeout=120)
        assert done["state"] == "succeeded", (name, done.get("error"))
        accuracy[name] = done["result"]["val_accuracy"]
    assert accuracy["npy"] > 0.5, accuracy  # chance is 0.1: it learned
    # the same samples in the same order under the same seed: the same training, whatever the files
    assert all(abs(a - accuracy["npy"]) < 1e-6 for a in accuracy.values()), accuracy
