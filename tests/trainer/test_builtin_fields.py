"""The built-in image models train on a dataset of named fields by its ``image`` and ``label``
fields (an image folder with ``?size=…&fields=image,label``), are scored on the provider's test split
the same way, and a dataset of named fields without a fixed-shape image is refused saying what to do.

A real router, provider and trainer (threads of this process, real sockets); images written with
Pillow (tests/support/images.py)."""

from __future__ import annotations

from libbus.wire.messages import SubmitJob
from tests.support.images import write_imagefolder
from tests.support.services import wait_job


def test_a_builtin_cnn_trains_on_the_image_and_label_fields_and_is_scored_on_them(
    tmp_path, router, start_provider, trainer, client_for
):
    root = write_imagefolder(tmp_path / "pets", per_class=12, classes=2, splits=("train", "test"))
    start_provider(f"pets=file://{root}?size=8&fields=image,label", assigned_only=False)
    admin = client_for(router.endpoint, role="admin", timeout_s=10)
    spec = {"dataset": "pets", "model": "cnn", "epochs": 2, "batch_size": 4, "evaluate": True, "max_attempts": 1}
    info = wait_job(admin, admin.request(SubmitJob(spec=spec)).job, timeout=120)
    assert info["state"] == "succeeded", info.get("error")
    result = info["result"]
    assert [r["epoch"] for r in result["history"]] == [1, 2]
    assert result["test_n"] == 24 and 0.0 <= result["test_accuracy"] <= 1.0  # scored on the provider's image/label


def test_named_fields_without_a_fixed_image_are_refused_naming_what_to_do(router, start_provider, trainer, client_for):
    start_provider("raw=mock://fields?n=40", assigned_only=False)  # variable-size images, tokens, text, label
    admin = client_for(router.endpoint, role="admin", timeout_s=10)
    spec = {"dataset": "raw", "model": "cnn", "epochs": 1, "evaluate": False, "max_attempts": 1}
    info = wait_job(admin, admin.request(SubmitJob(spec=spec)).job, timeout=120)
    assert info["state"] == "failed"
    assert "field 'image' is uint8 of shape [None, None, 3]" in info["error"] and "resize" in info["error"], info
