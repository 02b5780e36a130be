"""README's "On one machine": router, provider and trainer as ``busctl start`` processes sharing one
state directory on loopback, the modules a job and an evaluator may come from given as flags
(``--job-modules``, ``--evaluator-modules``); an entrypoint job trains, its model is downloaded and
scored by an evaluation task with an evaluator, no ``--arch``. (Ports are the system's choice here,
where the README names two.)"""

from __future__ import annotations

import re

from tests.support.busctl import REPO
from tests.support.cluster import Cluster


def test_the_one_machine_recipe_with_module_flags(tmp_path):
    cluster = Cluster(tmp_path / "state", env={"PYTHONPATH": str(REPO), "COLUMNS": "250"})
    try:
        cluster.start_router()
        cluster.start(
            "provider",
            "provider",
            "--bind",
            "tcp://127.0.0.1:0",
            "--dataset",
            "mnist=mock://mnist?n=600",
            "--evaluator-modules",
            "tests.support.",
            "--eval-epsilon",  # over the cluster's BATCHBUS_EVAL_EPSILON=0: the flag wins
            "0.1",
            ready=True,
        )
        cluster.endpoint_of("provider")
        cluster.start_trainer("trainer", "--job-modules", "tests.support.")
        job = cluster.busctl(
            "submit", "--dataset", "mnist", "--entrypoint", "tests.support.entrypoints:linear_classifier"
        ).stdout.strip()
        assert cluster.wait_end(job, timeout=120)["state"] == "succeeded", cluster.logs()
        model = tmp_path / "model.safetensors"
        downloaded = cluster.busctl("job", "model", job, "-o", str(model)).stdout
        digest = re.search(r"weights digest ([0-9a-f]{64})", downloaded)
        assert digest, downloaded
        assert digest.group(1) in cluster.busctl("job", "show", job).stdout
        task = cluster.busctl(
            "submit", "--evaluate", "--model", str(model), "--dataset", "mnist",
            "--evaluator", "tests.support.evaluators:linear",
        ).stdout.strip()  # fmt: skip
        info = cluster.wait_end(task, timeout=120)
        assert info["state"] == "succeeded", (info.get("error"), cluster.logs())
        shown = cluster.busctl("job", "show", task).stdout
        assert re.search(r"test accuracy \d\.\d{4} ± \d\.\d{4} at 95%", shown), shown  # --eval-epsilon applied
    finally:
        cluster.close()
