"""An entrypoint job that names no ``epochs`` has no total the displays could know: ``busctl job watch``,
``busctl job show`` and ``busctl jobs`` say the epoch it is in, counted from 1 in each, and no "of N"
(they said "epoch 2/2" from the built-in loop's default, and "epoch 3" would have been made up at its
end); a job that names its epochs keeps "N/M". Against real router, provider and trainer processes."""

from __future__ import annotations

import re

import pytest

from cli.tables import epoch_of
from tests.support.jobs import EntryCluster

#: Any "epoch N/M" a display draws.
WITH_TOTAL = re.compile(r"epoch \d+/\d+")


@pytest.mark.parametrize(
    "report, succeeded, shown",
    [
        ({"epoch": 0, "epochs": None, "step": 3, "steps_per_epoch": 10}, False, "1"),
        ({"epoch": 1, "epochs": None, "step": 10, "steps_per_epoch": 10}, False, "1"),  # epoch 1 just ended
        ({"epoch": 1, "epochs": None, "step": 12, "steps_per_epoch": 10}, False, "2"),
        ({"epoch": 2, "epochs": None, "step": 20, "steps_per_epoch": 10}, True, "2"),  # not a third
        ({"epoch": 1, "epochs": None, "step": 15, "steps_per_epoch": 10}, True, "2"),  # returned mid-epoch 2
        ({"epoch": 3, "step": 7}, True, "3"),  # no train loader: three epochs reported, then it returned
        ({"epoch": 3, "step": 7}, False, "4"),  # ... while it runs, the fourth is under way
        ({"epoch": 2, "epochs": 2, "step": 20, "steps_per_epoch": 10}, True, "2/2"),  # a known total stays
        ({"epoch": 0, "epochs": 4, "step": 1, "steps_per_epoch": 10}, False, "1/4"),
        ({"epochs": 4}, False, "?/4"),
    ],
)
def test_the_epoch_shown_says_only_what_the_report_knows(report, succeeded, shown):
    assert epoch_of(report, succeeded=succeeded) == shown


@pytest.mark.timeout(300)
def test_an_entrypoint_without_epochs_is_shown_without_a_total(tmp_path):
    cluster = EntryCluster(tmp_path / "state")
    cluster.env["COLUMNS"] = "220"  # busctl jobs' table on one line a row
    try:
        cluster.start_router()
        cluster.start_provider()
        cluster.endpoint_of("provider")
        cluster.start_trainer("trainer-e")
        spec = {"dataset": "mnist", "entrypoint": "tests.support.entrypoints:known_losses", "max_attempts": 1}
        job = cluster.submit_spec(spec)
        watched = cluster.busctl("job", "watch", job, timeout=240).stdout
        info = cluster.job(job)
        assert info["state"] == "succeeded" and info["progress"]["epochs"] is None, info["progress"]
        steps = info["progress"]["step"]

        assert not WITH_TOTAL.search(watched), watched
        bars = [int(n) for n in re.findall(r"^epoch (\d+) ", watched, re.M)]
        assert bars and set(bars) <= {1, 2}, watched  # counted from 1, as show does; no third
        show = cluster.busctl("job", "show", job, "--progress", "1000").stdout
        assert f"progress: epoch 2 step {steps} " in show and not WITH_TOTAL.search(show), show
        rows = cluster.busctl("jobs").stdout
        row = next(line for line in rows.splitlines() if job in line)
        assert re.search(r"epoch 2\b", row) and not WITH_TOTAL.search(row), row

        # the same function told its epochs keeps its total
        told = cluster.submit_spec(
            {**spec, "entrypoint": "tests.support.entrypoints:parabola"} | {"params": {"x": 0.5, "epochs": 2}}
        )
        assert cluster.wait_end(told, timeout=180)["state"] == "succeeded"
        show = cluster.busctl("job", "show", told).stdout
        assert "progress: epoch 2/2 " in show, show
    finally:
        cluster.close()
