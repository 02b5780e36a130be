"""A job trains the CNN through router, provider and trainer on generated
images of varying sizes and colour modes, decoded on the provider — from an ImageFolder tree and from
WebDataset shards — to the accuracy the data allows (classes differ by colour: any classifier separates
them, so the bar is near 1)."""

import pytest
import torch

from libbus.wire.messages import DatasetInfoRequest, SubmitJob
from services.models import build_model
from tests.support import wait_job
from tests.support.images import write_imagefolder, write_shards


@pytest.mark.parametrize("layout", ["imagefolder", "webdataset"])
def test_a_job_trains_the_cnn_on_images_decoded_by_the_provider(
    tmp_path, layout, router, start_provider, trainer, client_for, make_token
):  # noqa: F811 - pytest fixture
    root = tmp_path / layout
    if layout == "imagefolder":
        write_imagefolder(root, per_class=24, classes=4, splits=("train", "test"))
    else:
        write_shards(root, "train", shards=4, per_shard=24, classes=4)
        write_shards(root, "test", shards=1, per_shard=24, classes=4)
    provider = start_provider(f"pics=file://{root}?size=16&augment=1&workers=2", assigned_only=True)
    info = (
        client_for(provider.endpoint, token=make_token(datasets=["pics"]))
        .request(DatasetInfoRequest(dataset="pics"))
        .info
    )
    assert (info["format"], info["dtype"], info["sample_shape"], info["num_classes"]) == (
        layout,
        "uint8",
        [3, 16, 16],
        4,
    )
    admin = client_for(router.endpoint, role="admin")
    spec = {"dataset": "pics", "model": "cnn", "epochs": 6, "batch_size": 16, "lr": 5e-3, "seed": 0}
    done = wait_job(admin, admin.request(SubmitJob(spec=spec)).job, timeout=90)
    assert done["state"] == "succeeded", done.get("error")
    result = done["result"]
    print(f"cnn on {layout}: val acc {result['val_accuracy']:.3f}, test acc {result['test_accuracy']:.3f}")
    assert result["val_accuracy"] >= 0.9 and result["test_n"] == 24 * (4 if layout == "imagefolder" else 1)
    assert result["test_accuracy"] >= 0.9  # chance is 0.25
    decoded = provider.service.handler.stats()["pipelines"]["pics"]["stages"][0]
    assert decoded["items_in"] > 0 and decoded["bad_images"] == 0


def test_resnet18_is_torchvisions_and_takes_images_of_any_size():
    info = {"sample_shape": [3, 224, 224], "num_classes": 1000, "kind": "image"}
    model = build_model("resnet18", info)
    assert sum(p.numel() for p in model.parameters()) == 11_689_512  # torchvision.models.resnet18()
    small = build_model("resnet18", {**info, "sample_shape": [3, 40, 40], "num_classes": 3}, {"width": 8}).eval()
    for shape in ((2, 3, 40, 40), (1, 3, 17, 23), (2, 3, 96, 64)):
        assert small(torch.zeros(shape)).shape == (shape[0], 3)


def test_busctl_datasets_shows_an_image_folder_as_3_s_s_uint8(tmp_path, router, start_provider, state_dir):
    from tests.support import busctl
    from tests.support.images import write_imagefolder

    root = write_imagefolder(tmp_path / "pets", per_class=3, classes=2)
    start_provider(f"pets=file://{root}?size=24", name="prov-img")
    out = busctl(
        "datasets", "--router", router.endpoint, "--state-dir", str(state_dir), timeout=60,
        env={"BATCHBUS_REQUEST_TIMEOUT_S": "5", "BATCHBUS_REQUEST_RETRIES": "0"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    for words in ("pets  (image)", "(3, 24, 24) uint8", "int64, 2 classes"):
        assert words in out.stdout, f"{words!r} missing from:\n{out.stdout}"
