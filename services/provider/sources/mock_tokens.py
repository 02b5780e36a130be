"""``mock://tokens``: a generated, deterministic token dataset with structure a language model can learn.

Token datasets share one layout (file-backed token shards use it too): a sample is ``seq_len + 1``
consecutive tokens (a model's input and, shifted by one, its next-token targets), ``kind = "tokens"``,
``dtype`` uint16 (uint32 when the vocabulary does not fit), no labels (``label_shape = (0,)``, so a
batch's ``y`` has shape ``(B, 0)``), ``num_classes`` = the vocabulary size, and DatasetInfo also carries
``seq_len`` and ``vocab_size``.

The mock's sequences come from a fixed random sparse Markov chain: every token has a few likely
successors (one with probability 1/2, one with 1/4, two with 1/8), and with probability ``noise`` the
next token is uniform instead. A model that learns the chain reaches a next-token loss of about
:attr:`MockTokens.entropy_per_token` nats, far below ``log(vocab)`` for a model that learns nothing.

Query parameters: ``n`` (train sequences, default 20000; val and test get a fifth each), ``seq_len``
(default 64), ``vocab`` (default 256), ``seed`` (default 0), ``noise`` (default 0.1).
"""

from __future__ import annotations

import math

import numpy as np

from libbus.errors import DatasetError

from .base import SPLITS, OpenRequest, Source, SourceInfo, stable_seed
from .splitmix import GAMMA as _M1
from .splitmix import MUL1 as _M2
from .splitmix import MUL2 as _M3

__all__ = ["MockTokens", "open_mock_tokens", "token_dtype"]

#: Each token's successors are drawn by picking one of 8 equally likely slots; slot → successor
#: number. Successor 0 fills 4 slots, 1 fills 2, 2 and 3 one each: probabilities 1/2, 1/4, 1/8, 1/8.
_SLOT_TO_SUCCESSOR = np.array([0, 0, 0, 0, 1, 1, 2, 3], np.int64)
_SUCCESSOR_P = np.bincount(_SLOT_TO_SUCCESSOR) / len(_SLOT_TO_SUCCESSOR)
#: The successor table is (vocab, 4): bounded so that a typo cannot ask for gigabytes.
MAX_VOCAB = 1 << 24


def token_dtype(vocab: int) -> np.dtype:
    """The narrowest token dtype the token-dataset layout allows for ``vocab`` tokens."""
    return np.dtype(np.uint16) if vocab <= 1 << 16 else np.dtype(np.uint32)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """A cheap, vectorised, well-mixed 64-bit hash: counter-based randomness, one value per token.
    Built from SplitMix64's constants but not SplitMix64 (:mod:`.splitmix`); kept, so the tokens stay."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps on purpose
        z = (z + _M1) * _M2
        z = (z ^ (z >> np.uint64(30))) * _M3
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


class MockTokens(Source):
    """Generated, deterministic token sequences from a sparse Markov chain (see the module doc)."""

    kind = "tokens"
    label_shape = (0,)
    label_dtype = np.dtype(np.int64)

    def __init__(
        self, uri: str, n: int = 20000, seq_len: int = 64, vocab: int = 256, seed: int = 0, noise: float = 0.1
    ):
        if n < 1:
            raise DatasetError(f"{uri}: n must be at least 1, got {n}")
        if seq_len < 1:
            raise DatasetError(f"{uri}: seq_len must be at least 1, got {seq_len}")
        if not 2 <= vocab <= MAX_VOCAB:
            raise DatasetError(f"{uri}: vocab must be between 2 and {MAX_VOCAB}, got {vocab}")
        if not 0.0 <= noise <= 1.0:
            raise DatasetError(f"{uri}: noise is a probability, between 0 and 1; got {noise}")
        self.uri = uri
        self.seq_len = seq_len
        self.vocab = vocab
        self.seed = seed
        self.noise = noise
        self.sample_shape = (seq_len + 1,)
        self.dtype = token_dtype(vocab)
        self.num_classes = vocab
        self.class_names = []
        small = max(1, n // 5)
        self.sizes = {"train": n, "val": small, "test": small}
        rng = np.random.default_rng(stable_seed("tokens-chain", vocab, seed))
        #: (vocab, 4): each token's likely successors, most likely first (they may coincide).
        self.successors = rng.integers(0, vocab, size=(vocab, len(_SUCCESSOR_P)), dtype=np.int64)
        # noise decided on 32 random bits: next token is uniform where bits < threshold
        self._noise_below = np.uint64(min(int(noise * 2**32), 2**32))

    def num_samples(self, split: str) -> int:
        return self.sizes[split]

    @property
    def entropy_per_token(self) -> float:
        """Mean next-token entropy (nats) of the chain: the loss an ideal model approaches.

        Averaged over current tokens uniformly (the chain's stationary distribution is close to
        uniform); exact enough to tell a model that learned the chain from one that did not.
        """
        q = self.noise / self.vocab  # every token's share of the uniform noise
        total = 0.0
        for start in range(0, self.vocab, 1 << 16):  # chunks bound the (rows, 4, 4) temporaries
            succ = self.successors[start : start + (1 << 16)]
            same = succ[:, :, None] == succ[:, None, :]
            # a successor listed twice in a row gets both shares; count each distinct token once
            p = q + (1 - self.noise) * (same * _SUCCESSOR_P[None, None, :]).sum(2)
            first = ~np.tril(same, -1).any(2)
            plogp = np.where(p > 0, -p * np.log(np.where(p > 0, p, 1.0)), 0.0)
            others = float((self.vocab - first.sum(1)).sum())  # tokens only noise reaches
            total += float((plogp * first).sum()) + (others * -q * math.log(q) if q > 0 else 0.0)
        return total / self.vocab

    def read(self, split: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        length = self.seq_len + 1
        base = np.uint64(stable_seed("tokens", self.seed, SPLITS.index(split)))
        # One counter per token of every requested sequence: (split, index, position) → hash, so a
        # sequence is the same whichever batch asks for it, and the batch is generated at once.
        counters: np.ndarray = indices.astype(np.uint64)[:, None] * np.uint64(length) + np.arange(
            length, dtype=np.uint64
        )
        with np.errstate(over="ignore"):
            decide = _splitmix64(counters ^ base)
            uniform = (_splitmix64(counters ^ (base * _M3)) % np.uint64(self.vocab)).astype(np.int64)
        successor = _SLOT_TO_SUCCESSOR[(decide & np.uint64(len(_SLOT_TO_SUCCESSOR) - 1)).astype(np.int64)]
        noisy = (decide >> np.uint64(32)) < self._noise_below
        out = np.empty((len(indices), length), np.int64)
        out[:, 0] = uniform[:, 0]
        # The chain is sequential in position but vectorised across the batch: seq_len + 1 steps.
        for t in range(1, length):
            chained = self.successors[out[:, t - 1], successor[:, t]]
            out[:, t] = np.where(noisy[:, t], uniform[:, t], chained)
        return out.astype(self.dtype), np.empty((len(indices), 0), self.label_dtype)

    def info(self) -> SourceInfo:
        return {**super().info(), "seq_len": self.seq_len, "vocab_size": self.vocab}


def open_mock_tokens(req: OpenRequest) -> MockTokens:
    """``mock://tokens?n=&seq_len=&vocab=&seed=&noise=`` → :class:`MockTokens` (pops what it reads).

    Raises :class:`DatasetError` naming a parameter that is malformed or out of range.
    """
    uri, params = req.uri, req.params
    n = req.int_param("n", 20000)
    seq_len = req.int_param("seq_len", 64)
    vocab = req.int_param("vocab", 256)
    seed = req.int_param("seed", 0)
    try:
        noise = float(params.pop("noise", 0.1))
    except ValueError as err:
        raise DatasetError(f"{uri}: 'noise' must be a number between 0 and 1") from err
    return MockTokens(uri, n=n, seq_len=seq_len, vocab=vocab, seed=seed, noise=noise)
