"""Who may do what: a reader token reads its datasets and nothing else (issue 30, item 6); on the default
set-up no trainer node holds anything that mints a token (issue 30, item 3)."""

from __future__ import annotations

import pytest
import torch

from libbus.connect.client import Client, Identity
from libbus.errors import Forbidden
from libbus.loader.remote import RemoteLoader
from libbus.wire.messages import Evaluate, GetJob, GetTask, Progress, PushResult, SubmitJob
from tests.support import CLUSTER


def _loader_client(endpoint: str, token: str, role: str = "reader", loader: bool = True) -> Client:
    caps = {"loader": True} if loader else {}
    return Client(endpoint, Identity(role=role, name="script", token=token, caps=caps), timeout_s=5.0, retries=0)


def test_a_reader_token_takes_no_job_and_pushes_nothing(router, start_provider, client_for, make_token):
    start_provider("mnist=mock://mnist?n=600", assigned_only=True)
    admin = client_for(router.endpoint, "admin")
    job = admin.request(SubmitJob(spec={"dataset": "mnist", "epochs": 1})).job
    reader = make_token("reader", sub="alice", datasets=["mnist"])

    script = _loader_client(router.endpoint, reader)
    try:
        for msg in (
            GetTask(),
            Progress(job=job, progress={"epoch": 1, "test_accuracy": 1.0}),
            PushResult(job=job, state="succeeded", result={"test_accuracy": 1.0}),
        ):
            with pytest.raises(Forbidden):
                script.request(msg)
    finally:
        script.close()
    # Without caps.loader it is not let in at all: a reader never acts as a trainer service.
    service = _loader_client(router.endpoint, reader, loader=False)
    try:
        with pytest.raises(Forbidden, match="loader sessions only"):
            service.request(GetTask())
    finally:
        service.close()
    assert admin.request(GetJob(job=job)).job["state"] == "queued"  # still there for a real trainer


def test_a_reader_token_trains_on_its_dataset_and_reads_no_other(router, start_provider, make_token):
    provider = start_provider(
        "mnist=mock://mnist?n=600", "zeros=dummy://?shape=2,3&n=100&classes=4", assigned_only=True
    )
    reader = make_token("reader", sub="alice", datasets=["mnist"])

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    with RemoteLoader("mnist", router=router.endpoint, token=reader, batch_size=60, seed=1) as loader:
        for _ in range(3):
            total = 0.0
            for x, y in loader:
                loss = torch.nn.functional.cross_entropy(model(x), y.long())
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += float(loss.detach())
            losses.append(total / len(loader))
    assert losses[-1] < 0.5 * losses[0], losses  # it learned from what the provider sent a reader

    with pytest.raises(Forbidden, match="scope"):
        with RemoteLoader("zeros", router=router.endpoint, token=reader, batch_size=10) as other:
            next(iter(other))
    # Evaluations are the trainer service's (the test split's scores): a reader is refused them.
    script = _loader_client(provider.endpoint, reader)
    try:
        with pytest.raises(Forbidden):
            script.request(Evaluate(dataset="mnist", model={"name": "mlp"}, frames=[b"\0" * 8]))
    finally:
        script.close()


def test_a_trainer_token_still_opens_loader_sessions(router, start_provider, make_token):
    start_provider("mnist=mock://mnist?n=600", assigned_only=False)
    with RemoteLoader("mnist", router=router.endpoint, token=make_token("trainer"), batch_size=100) as loader:
        assert sum(1 for _ in loader) == len(loader) > 0


def test_busctl_issues_reader_tokens(state_dir):
    from libbus.security.auth import load_secret, verify_token
    from tests.support import busctl

    out = busctl("token", "issue", "--role", "reader", "--dataset", "mnist", "--state-dir", str(state_dir), check=True)
    claims = verify_token(out.stdout.strip(), load_secret(state_dir / "secret"), audience=CLUSTER)
    assert claims.role == "reader" and claims.scopes["datasets"] == ["mnist"]
