"""DatasetInfo's ``info``, as typed records: what a provider's source says of its dataset (docs/protocol.md).

It travels as JSON inside :class:`~libbus.wire.msg_data.DatasetInfo`; these ``TypedDict``\\ s name its keys
for the code that builds it (a source, its format, its location) and the code that reads it, the bytes
unchanged. Every key but a split's is optional: a source says what it knows (a token dataset its
``seq_len``, an object store its ``store``, a pipeline its ``stages``)."""

from __future__ import annotations

from typing import NotRequired, TypedDict

__all__ = [
    "FieldInfo",
    "JoinInfo",
    "JoinSplitInfo",
    "MemberInfo",
    "ProviderEntry",
    "SourceInfo",
    "SplitInfo",
    "StageInfo",
]


class FieldInfo(TypedDict):
    """One entry of ``fields``: a named field's dtype and per-sample shape (``None``: a variable size)."""

    name: str
    dtype: str
    shape: list[int | None]
    #: A variable field's bound on one sample's bytes.
    max_bytes: NotRequired[int]


class SplitInfo(TypedDict):
    """One entry of ``splits``: its samples, and whether a trainer may read (and shuffle) it."""

    num_samples: int
    available: bool
    shuffle: bool


class MemberInfo(TypedDict):
    """One member of a weighted mix (``sources``): the dataset it serves under, its URI, its train share."""

    name: str
    uri: str
    train_share: float


class StageInfo(TypedDict):
    """One stage of a pipeline (``stages``)."""

    name: str
    type: str


class JoinSplitInfo(TypedDict):
    """A joining ``pack``'s count of one split: documents and tokens read, samples cut, tokens dropped."""

    documents: int
    tokens: int
    samples: int
    dropped: int
    kept_mb: float
    cached: bool


class JoinInfo(TypedDict):
    """A joining ``pack`` stage (``pack``): the sample length and each split's counts."""

    length: int
    join: bool
    splits: dict[str, JoinSplitInfo]


class SourceInfo(TypedDict, total=False):
    """DatasetInfo's ``info``: ``fields`` is the truth; an x/y dataset also keeps the keys older readers
    know (``sample_shape``, ``dtype``, ``label_shape``, ``label_dtype``). The rest say where and how the
    dataset is kept (``format``, ``path``, ``store``…): shown to operators, never needed to read it."""

    uri: str
    splits: dict[str, SplitInfo]
    fields: list[FieldInfo]
    sample_shape: list[int]
    label_shape: list[int]
    dtype: str
    label_dtype: str
    num_classes: int
    class_names: list[str]
    kind: str
    # token datasets
    seq_len: int
    vocab_size: int
    token_bytes: int
    # the layout: its format, where it lies, how it is read
    format: str
    path: str
    memory: str
    read_ahead: bool
    #: its provider reads it over the network (a store, ``http(s)://``)
    remote: bool
    files: int
    shards: int
    #: a Parquet or Arrow table's feature columns; an MDS shard's columns with their encodings
    columns: list[str] | dict[str, str]
    label_column: str | None
    features: dict[str, str]
    augment: bool
    workers: int
    # val carved out of train (the files hold no val split)
    val_fraction: float
    val_carved: str
    # a remote location: an object store's scheme, a Hub repository and its commit
    store: str
    repo: str
    revision: str
    # a weighted mix, a pipeline
    sources: list[MemberInfo]
    source_uri: str
    stages: list[StageInfo]
    pack: JoinInfo


class ProviderEntry(TypedDict):
    """One of ``Resolved.providers``: a provider serving the dataset, and how to reach it."""

    name: str
    endpoint: str
    host_id: str
    #: its data socket's CURVE public key (Z85), ``""`` without CURVE
    curve_key: str
