"""Text stages of a pipeline: ``tokenize`` (Hugging Face ``tokenizers``) and ``pack`` (docs/datasets.md §7.1).

Their input is a source of text samples (``file://DIR?encoded=1`` on ``train.txt`` files, WebDataset
shards with ``.txt`` members, or a Parquet string column: ``parquet://DIR?encoded=1``). ``tokenize``
turns each sample's text into token ids with the tokenizer JSON file the operator gives
(``tokenizer.json``, as ``tokenizers`` saves it; nothing is downloaded), ``encode_batch`` running on
the tokenizer's own Rust threads; ``pack`` makes the fixed-length token
samples that ``tiny-lm`` and every token dataset use: ``length + 1`` tokens (a model's input and, shifted
by one, its targets), a document cut at that length or padded with ``pad_id`` after its end token, or
with ``join = true`` the documents' token stream cut into samples (:mod:`.text_join`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np

from libbus.errors import ConfigError, DatasetError
from libbus.wire.dataset_info import JoinInfo

from .stages import Chunk, Spec, Stage
from .text_index_cache import cache_path, load_counts, save_counts
from .text_join import JoinIndex

__all__ = ["TEXT_STAGES"]

TOKEN_LISTS = "token_lists"
#: ``pack`` with ``join``: megabytes of joined token ids kept in memory (all splits together) by default.
KEEP_MB = 256


class Tokenize(Stage[Spec]):
    """``tokenize``: text → token ids, with ``tokenizer`` (a ``tokenizer.json`` path); ``eos`` (a token
    string, e.g. ``"</s>"``) is appended to every document when given."""

    type = "tokenize"
    params = {"tokenizer": None, "eos": None}

    def check(self, spec: Spec) -> Spec:
        if spec.kind != "encoded":
            raise self.error(f"needs text samples (a source with encoded=1), got {spec.kind} samples")
        path = self.config["tokenizer"]
        if not isinstance(path, str) or not path:
            raise self.error('needs tokenizer = "/path/to/tokenizer.json"')
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise self.error("needs the tokenizers package: pip install 'batchbus[images]'") from None
        if not Path(path).is_file():
            raise self.error(f"tokenizer file {path} does not exist")
        try:
            self.tokenizer = Tokenizer.from_file(path)
        except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad file
            raise self.error(f"{path} is not a tokenizers JSON file: {err}") from None
        # A tokenizer saved with padding would pad each document to its batch's longest: tokens that depend
        # on what else is in the batch, and padding inside a document; pack pads (or joins) on its own.
        self.tokenizer.no_padding()
        self.vocab = self.tokenizer.get_vocab_size()
        self.eos = None
        if self.config["eos"] is not None:
            self.eos = self.tokenizer.token_to_id(self.config["eos"])
            if self.eos is None:
                raise self.error(f"eos token {self.config['eos']!r} is not in the tokenizer's vocabulary")
        return replace(spec, kind=TOKEN_LISTS, num_classes=self.vocab, label_shape=(0,))

    def apply(self, chunk: Chunk) -> None:
        texts = []
        for sample in chunk.xy()[0]:
            if sample.text is None:
                raise DatasetError(f"stage {self.name!r} (tokenize): sample {sample.where} has no text (.txt member)")
            texts.append(sample.text)
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=True)
        out = np.empty(len(texts), object)
        for i, enc in enumerate(encodings):
            ids = enc.ids + ([self.eos] if self.eos is not None else [])
            out[i] = np.asarray(ids, np.int64)
        chunk.x = out
        chunk.y = np.empty((len(texts), 0), np.int64)


class Pack(Stage[Spec]):
    """``pack``: token ids → fixed ``length + 1`` token samples: one per document (cut, or padded with
    ``pad_id``), or with ``join = true`` the documents' token stream cut into samples (:mod:`.text_join`).

    A joining pack makes each sample from a run of its input's documents, so it tells the pipeline so
    (``regroups``): the pipeline builds its index when it opens (:meth:`build_index`), counts its samples
    with :meth:`num_samples` and sends a batch's chunk through the stages before it as the documents
    :meth:`source_indices` names, the requested samples riding along in ``Chunk.requested``."""

    type = "pack"
    params = {"length": None, "pad_id": 0, "join": False, "keep_mb": None, "index_cache": None}

    def check(self, spec: Spec) -> Spec:
        if spec.kind != TOKEN_LISTS:
            raise self.error(f"needs token ids (after tokenize), got {spec.kind} samples")
        length, pad, join = self.config["length"], self.config["pad_id"], self.config["join"]
        if not isinstance(length, int) or isinstance(length, bool) or not 1 <= length <= 1 << 20:
            raise self.error(f"length must be a positive number of tokens, got {length!r}")
        if not isinstance(pad, int) or isinstance(pad, bool) or not 0 <= pad < spec.num_classes:
            raise self.error(f"pad_id must be a token id below the vocabulary's {spec.num_classes}, got {pad!r}")
        if not isinstance(join, bool):
            raise self.error(f"join must be true or false, got {join!r}")
        keep = self.config["keep_mb"]
        if keep is not None and not join:
            raise self.error("keep_mb goes with join = true (the joined token stream kept in memory)")
        if keep is not None and (not isinstance(keep, (int, float)) or isinstance(keep, bool) or keep < 0):
            raise self.error(f"keep_mb must be a number of megabytes (0: keep no tokens), got {keep!r}")
        self.config["keep_mb"] = KEEP_MB if keep is None else keep
        cache = self.config["index_cache"]
        if cache is not None and (not join or keep != 0):
            raise self.error("index_cache goes with join = true and keep_mb = 0 (kept tokens need the pass anyway)")
        if cache is not None and (not isinstance(cache, str) or not Path(cache).is_dir()):
            raise self.error(f"index_cache must name an existing directory, got {cache!r}")
        #: True: samples cut from the documents' joined stream (the pipeline asks the hooks below).
        self.regroups = join
        self.indexes: dict[str, JoinIndex] = {}
        dtype = np.dtype(np.uint16) if spec.num_classes <= 1 << 16 else np.dtype(np.uint32)
        return replace(spec, sample_shape=(length + 1,), dtype=dtype, kind="tokens")

    # -- join = true: the pipeline's hooks ------------------------------------------------------
    def build_index(
        self, read: Callable[[str, np.ndarray], np.ndarray], documents: dict[str, int], before: list[Stage]
    ) -> None:
        """Tokenize every document of each split once (``read(split, indices)`` gives token ids, through
        the stages ``before`` this one) and keep their offsets, or read them from ``index_cache``.
        Refuses (:class:`ConfigError`) a split of documents too short for one sample."""
        width = self.config["length"] + 1
        budget = int(self.config["keep_mb"] * 2**20)  # for all splits together
        path = cached = None
        if self.config["index_cache"] is not None:
            stages = [(s.type, s.config) for s in before]
            try:
                path = cache_path(self.config["index_cache"], before[0].config["uri"], stages)
            except ConfigError as err:
                raise self.error(str(err)) from None
            cached = load_counts(path, documents)
        for split, count in documents.items():
            if cached is not None:
                index = JoinIndex(cached[split], width, cached=True)
            else:
                index = JoinIndex.build(partial(read, split), count, width, self.spec.dtype, budget)
            if index.stream is not None:
                budget -= index.stream.nbytes
            if count and not index.num_samples:
                raise self.error(
                    f"join makes no {split} sample: its {count} documents hold {index.tokens} tokens, fewer "
                    f"than one sample of length + 1 = {width}; lower length (or leave join out: one sample "
                    "per document)"
                )
            self.indexes[split] = index
        if path is not None and cached is None:
            save_counts(path, {split: np.diff(index.offsets) for split, index in self.indexes.items()})

    def num_samples(self, split: str) -> int:
        """Whole samples in ``split``'s token stream (the last partial one dropped)."""
        index = self.indexes.get(split)
        return index.num_samples if index is not None else 0

    def source_indices(self, split: str, samples: np.ndarray) -> np.ndarray:
        """The documents (sorted, each once) that ``samples`` are cut from."""
        return self.indexes[split].documents_of(samples)

    def join_info(self) -> JoinInfo:
        """Per split: documents, tokens, samples and the tokens dropped at the end (DatasetInfo ``pack``)."""
        splits = {split: index.info() for split, index in self.indexes.items()}
        return {"length": self.config["length"], "join": True, "splits": splits}

    def apply(self, chunk: Chunk) -> None:
        if self.regroups:
            samples = chunk.requested
            assert samples is not None, "the pipeline sends a joining pack the requested samples"
            index = self.indexes[chunk.split]
            chunk.x = index.assemble(samples, chunk.indices, chunk.x, self.spec.dtype, chunk.split)
            chunk.indices, chunk.y = samples, np.empty((len(samples), 0), np.int64)
            return
        n = self.spec.sample_shape[0]
        lists = chunk.xy()[0]
        out = np.full((len(lists), n), self.config["pad_id"], self.spec.dtype)
        for i, ids in enumerate(lists):
            out[i, : min(n, len(ids))] = ids[:n]
        chunk.x = out


#: Text stage types by their TOML key.
TEXT_STAGES: dict[str, type[Stage]] = {cls.type: cls for cls in (Tokenize, Pack)}
