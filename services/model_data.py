"""What a built-in model reads of a dataset, without torch: its ``kind``, and the x/y view of a dataset
of named fields (:func:`xy_info`). The provider checks a job's dataset with it on every batch path,
so it lives apart from :mod:`services.models` (torch): a provider imports torch only to evaluate."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from libbus.errors import BadRequest
from libbus.wire.dataset_info import SourceInfo

__all__ = ["FIELDS", "IMAGE_FIELD", "LABEL_FIELD", "TOKENS", "dataset_kind", "xy_info"]

#: DatasetInfo ``kind`` of token datasets; every other kind is classified sample by sample.
TOKENS = "tokens"
#: DatasetInfo ``kind`` of datasets of named fields; the built-in models read two of them.
FIELDS = "fields"
#: The named fields a built-in model reads from such a dataset, as ``x`` and ``y``.
IMAGE_FIELD, LABEL_FIELD = "image", "label"


def xy_info(info: Mapping[str, Any]) -> SourceInfo:
    """``info`` as a built-in model sizes itself by: an x/y dataset's own; for a dataset of named
    fields, its ``image`` field (fixed shape, numbers) as the sample and its ``label`` field (one
    class id) as the label — an image folder or WebDataset shards with ``?size=…&fields=image,label``,
    or any format whose fields are named so.

    Raises:
        BadRequest: named fields without those two, or of a kind no built-in model reads; the message
            names the fields and says what to do.
    """
    given = cast(SourceInfo, info)  # a provider's DatasetInfo, as it sent it
    if dataset_kind(info) != FIELDS:
        return given
    fields = {f.get("name"): f for f in info.get("fields", []) if isinstance(f, dict)}
    image, label = fields.get(IMAGE_FIELD), fields.get(LABEL_FIELD)
    if image is None or label is None:
        raise BadRequest(
            f"the built-in models train on x/y datasets or on named fields {IMAGE_FIELD!r} and {LABEL_FIELD!r}; "
            f"this dataset's fields are {', '.join(map(str, fields)) or 'none'}: name yours so (the format's "
            "?fields= and ?label=), serve it through a pipeline, or train it with your own entrypoint"
        )
    shape, dtype = image.get("shape"), str(image.get("dtype"))
    if not isinstance(shape, list) or None in shape or dtype in ("bytes", "str"):
        raise BadRequest(
            f"field {IMAGE_FIELD!r} is {dtype} of shape {shape}: the built-in models need samples of one "
            "fixed shape of numbers (decode and resize them on the provider: ?size= for image folders, "
            "or a pipeline's decode and resize stages)"
        )
    if label.get("shape") != [] or not str(label.get("dtype", "")).startswith(("int", "uint")):
        raise BadRequest(f"field {LABEL_FIELD!r} must hold one integer class id per sample, not {label}")
    return {
        **given,
        "kind": "image",
        "sample_shape": [s for s in shape if s is not None],  # none is: checked above
        "dtype": dtype,
        "label_shape": [],
        "label_dtype": label["dtype"],
    }


def dataset_kind(info: Mapping[str, Any]) -> str:
    """The dataset's ``kind`` from its DatasetInfo; sources that predate the field are images."""
    return info.get("kind", "image")
