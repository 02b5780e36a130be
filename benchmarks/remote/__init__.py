"""Data behind a network: a provider reading a store with a fixed delay per request, and its local
datasets beside it.

One invocation, one generated CIFAR-shaped dataset (:func:`benchmarks.delivery.make_dataset`:
float32 3×32×32 + int64 label, 12,296 B a sample), one router and one provider (real processes)
serving it three ways, and a store process holding the test suite's range server
(``tests/support/httpd.py``, so run it from a checkout) and, for the MDS rows, its S3 server (moto
behind a proxy, ``tests/support/s3server.py``). The store answers every request after
``--latency-ms`` (each value in turn, set while the provider runs), as an object store's first byte
comes late. Every row is a ``RemoteLoader(batch_size=256)`` (``--batch``) read for ``--seconds``,
each batch's samples checked against the dataset by content:

=================  ==================================================================================
file               ``file://`` on the provider's disk: the local baseline (``block`` and ``full`` shuffle)
http               the ``.npy`` pair as ``http://`` from the range server, per latency and shuffle
s3-mds             the samples as MDS shards (Streaming's ``MDSWriter``, ``--mds-shard-mb``) at ``s3://``
mosaic             MosaicML Streaming's ``StreamingDataset`` (``shuffle=True``) + DataLoader
                   (``--workers``) reading the same MDS from the same store (a fresh local cache each
                   row: a cold read), in a process of its own
head-of-line       a local dataset's wait per batch (the same files held in the provider's RAM), a loop
                   of ``--step-ms`` per step, alone, while another loader reads ``http`` (full
                   shuffle, ``--hol-latency-ms``) from the same provider, and while it reads it from a
                   provider of its own (the control); the store and the other loaders on the last core,
                   as other machines (``--hol-share-cores``: every process on every core); meanwhile a
                   new client's ``Hello`` and ``DatasetInfo`` timed every 0.25 s (the worst is what a
                   new trainer would wait); ``--hol-busy N``: every phase beside N busy loops (a
                   deliberate load, each ending by itself)
htb (``--htb``)    the store in a network namespace of its own behind a veth capped at ``--htb-mbit``
                   by ``htb`` (root only), the provider and loader in another: block shuffle's MB/s as a
                   fraction of the cap, at ``--htb-latency-ms`` (its loader's first batches left out, and
                   the link's own byte counter over the same window); ``--htb-ram-cache``: read ahead
=================  ==================================================================================

``samples/s`` counts from a row's first batch to its last (start-up apart: ``first_s`` is the
time to the first batch); ``MB/s`` is samples/s × 12,296 B; ``× file`` is the ratio to the
``file`` row of the same shuffle, ``× mosaic`` an ``s3-mds`` row's ratio to ``mosaic`` at the same
latency. A row's loader gives up at its first request unanswered within 10 s
(:data:`~benchmarks.remote.cluster.FAIL_FAST`): the row then says why in place of its figures, and the next row
waits until the provider and the store are idle again. ::

    python -m benchmarks.remote --latency-ms 0,10,30,100 --seconds 5 --json remote.json
    python -m benchmarks.remote --quick
    python -m benchmarks.remote --quick --hol-only   # the head-of-line part alone
    python -m benchmarks.remote --hol-only --seconds 5 --hol-busy 2   # ... beside two spinning cores

The parts, one module each: :mod:`~benchmarks.remote.checks` (reading a loader for a window, every batch
checked by content), :mod:`~benchmarks.remote.cluster` (the store process, the router and provider),
:mod:`~benchmarks.remote.streaming` (the MDS shards and the ``mosaic`` row),
:mod:`~benchmarks.remote.head_of_line`, :mod:`~benchmarks.remote.capped_link` (the ``--htb`` row),
:mod:`~benchmarks.remote.rows` (one run, every row in turn) and :mod:`~benchmarks.remote.command` (the
options and the printed tables).
"""

from benchmarks.remote.command import main
from benchmarks.remote.rows import run

__all__ = ["main", "run"]
