"""The flows benchmark's set-up, small: two network namespaces, a veth whose every connection is
capped by an ``htb`` class of its own (a ``u32`` filter on the loader's port), a router and a
provider in one namespace, a loader process in the other (:mod:`benchmarks.flows`).

With ``flows=2`` the batches travel on two connections, each shaped by its own class, and two
epochs arrive sample for sample in the loader's order; with ``flows=1``, on one. Timings are the
benchmark's business, not this test's. Needs root (namespaces, qdiscs); skipped elsewhere with the reason.
"""

from __future__ import annotations

import pytest

from benchmarks.flows import CappedLink, Services, measure, netns_unavailable

SKIP = netns_unavailable()
pytestmark = pytest.mark.skipif(bool(SKIP), reason=SKIP or "")

URI = "mock://mnist?n=600"
BATCH = 20
SAMPLE_BYTES = 28 * 28 + 8  # uint8 image + int64 label


def test_each_flow_is_a_capped_connection_of_its_own_and_every_sample_arrives_once(tmp_path):
    link = CappedLink(rate_mbit=50)
    try:
        services = Services(link, tmp_path / "state", [f"mnist={URI}"])
        try:
            args = {"batch": BATCH, "inflight": 4, "verify": URI, "epochs": 2, "batch_bytes": BATCH * SAMPLE_BYTES}
            for flows in (1, 2):
                row = measure(link, services, "mnist", flows, args, timeout_s=240)
                assert row["exact"], f"flows={flows}: the epochs were not every sample once, in order"
                assert row["flows"] == flows and row["connections"] == flows
                assert all(n > 0 for n in row["received"]), row
                # the batches crossed the link on as many connections, each shaped by its own class
                assert row["classes_used"] == flows, row
        finally:
            services.stop()
    finally:
        link.close()
