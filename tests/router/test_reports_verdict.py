"""An epoch's report waits for the router's verdict on it (early stopping, a study's pruner: it rides
on the reply), but a router that is away does not hold training up: one unanswered try ends the wait,
and the report is kept for when the router is back. A real router and link on loopback."""

from __future__ import annotations

from libbus.connect.client import Identity
from libbus.connect.link import Link
from libbus.wire.messages import Progress
from services.trainer import reports
from services.trainer.reports import Reporter


def test_an_epochs_report_does_not_wait_out_a_router_that_is_away(router, make_token, monkeypatch):
    # were the wait not ended by the unanswered try, this test would hit pytest's timeout
    monkeypatch.setattr(reports, "VERDICT_WAIT_S", 1000.0)
    link = Link(router.endpoint, Identity(role="trainer", name="t-verdict", token=make_token()), heartbeat_ms=100)
    link.start()
    reporter = Reporter(link, "j0123456789", timeout_s=1.0)
    try:
        assert link.connected.wait(10)
        router.shutdown()  # the router goes away between two epochs
        reporter.put(Progress(job="j0123456789", progress={"epoch": 1, "history": [{"epoch": 1}]}))
        assert reporter.await_verdict() is False  # training goes on
        assert reporter.pending == 1 and reporter.lost is None  # kept for when the router is back
    finally:
        reporter.close()
        link.close()
