"""The provider's decode cache: samples as they leave a pipeline's deterministic prefix, and pipelines'
final outputs, kept once for every job that reads them.

A pipeline's stages up to (not including) its first random stage give the same sample for the same
(split, index) whatever the job, its seed or its epoch: the source read, ``decode``, ``resize``,
``normalize`` … That output is what the cache keeps, so that every job and every trial of a study
reading the dataset shares one decode, while the random stages after it still run per request from
(seed, epoch, index): each job's bytes are those of an uncached run (docs/datasets.md §7.7).

Its parts, lowest first (each imports only the ones before it, and none imports the pipeline that uses
the cache: ``tests/project/test_layers.py``):

- :mod:`.entries`: what is kept and under which key. An :class:`~.entries.Entry` (a sample's value and
  label), a decoded sample's key ``(dataset, split, index, digest of the prefix's stage types and
  parameters)`` and a final output's, which adds the random stages' seeds and epochs; two pipelines,
  datasets or splits never share an entry unless they would produce the same sample. And the order in
  which entries make room, which both tiers follow (:func:`~.entries.make_room`).
- :mod:`.disk_tier`: the optional disk tier under a directory of its own, which takes what the RAM tier
  evicts and gives it back on a hit. Each file carries a magic, its key and a BLAKE2b digest of its key
  and contents: a truncated, corrupt or foreign file is a miss (the sample is decoded again), counted and
  removed, never served. Files are opened relative to the directory with ``O_NOFOLLOW`` and the directory
  itself must not be a symlink, so the tier never reads or writes outside it. The directory is emptied
  when the cache opens and when it closes (the source files may have changed while the provider was
  down).
- :mod:`.store`: :class:`~.store.DecodeCache`, one per provider, shared by its pipelines: a RAM tier of at
  most ``ram_bytes``, least recently used first out, over the disk tier; the claims that make requests
  missing the same sample at once decode it once (the first claims it, the others wait for its store, at
  most until their batch's deadline or the pipeline stops, and take it from the cache; a claim whose
  chunk fails or is dropped is released, and a waiter then decodes the sample itself); its counters.
- :mod:`.pipeline_bindings`: one pipeline's two bindings to the store. :class:`~.pipeline_bindings.PrefixCache`
  answers a chunk's samples from its deterministic prefix's entries and stores the misses;
  :class:`~.pipeline_bindings.FinalCache` does the same for whole batches of final outputs.

**Final outputs.** A pipeline's random stages draw from ``(seed, epoch, split, stage, index)`` alone
(:class:`~..stages.RandomStage`: the stage's seed from the pipeline file or a control command, the
request's epoch unless one is pinned), never from the job that asks. So the whole pipeline's output
for a sample is a function of the key ``(dataset, split, index, digest of every stage, the random
stages' seeds and epochs)``, and :class:`~.pipeline_bindings.FinalCache` keeps it in the same cache: every
job reading an epoch of the dataset after the first gets its samples without running any stage, byte for
byte. Final entries are second in line for the byte budget (both tiers): a decoded entry evicts final
entries before any decoded one, and a final entry evicts only final entries (it is not kept when the
decoded ones leave no room), since a final entry serves one epoch while a decoded one serves every epoch.

This face re-exports every submodule's ``__all__``; inside the pipeline, import the submodule itself.
"""

from __future__ import annotations

from . import disk_tier as _disk_tier
from . import entries as _entries
from . import pipeline_bindings as _pipeline_bindings
from . import store as _store
from .disk_tier import *  # noqa: F403
from .entries import *  # noqa: F403
from .pipeline_bindings import *  # noqa: F403
from .store import *  # noqa: F403

__all__ = [*_entries.__all__, *_disk_tier.__all__, *_store.__all__, *_pipeline_bindings.__all__]
