"""Where a dataset's bytes live and how they are read, whatever their layout: positional, coalescing reads
of local files (:mod:`.reader`), HTTP ranges (:mod:`.httprange`, off the GIL through obstore in
:mod:`.httpstore`), object stores (:mod:`.objects`, on
``obstore`` through :mod:`.obstore_backend`), the caches in between (:mod:`.blockcache` on disk,
:mod:`.blockmemory` in RAM, :mod:`.decompress` decompressing once), the requests kept in flight
(:mod:`.inflight`) and confinement of a ``file://`` dataset to its directory (:mod:`.confine`).

A new storage backend goes here; the layouts (:mod:`services.provider.sources.formats`) read through these
modules and are imported by none of them (``tests/project/test_layers.py``)."""
