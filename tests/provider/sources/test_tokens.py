"""Token datasets: ``mock://tokens`` through a real provider, the ``tiny-lm`` model, and a job that trains
it end to end through router, provider and trainer on loopback sockets."""

import math
import time

import numpy as np
import pytest
import torch

from libbus.errors import BadRequest, DatasetError
from libbus.wire.messages import BatchRequest, DatasetInfoRequest, SubmitJob
from services.models import build_model, evaluate
from services.provider.sources import open_source
from tests.support import wait_job

TOKENS = "mock://tokens?n=640&seq_len=32&vocab=64"


def arrays(reply):
    x = np.frombuffer(reply.frames[0].buffer, reply.dtypes[0]).reshape(reply.shapes[0])
    y = np.frombuffer(reply.frames[1].buffer, reply.dtypes[1]).reshape(reply.shapes[1])
    return x, y


def test_token_batches_through_the_provider_are_deterministic_sequences(start_provider, client_for):
    provider = start_provider(f"tok={TOKENS}")
    client = client_for(provider.endpoint)
    info = client.request(DatasetInfoRequest(dataset="tok")).info
    assert info["kind"] == "tokens" and info["seq_len"] == 32 and info["vocab_size"] == 64
    assert info["sample_shape"] == [33] and info["label_shape"] == [0]
    assert info["dtype"] == "uint16" and info["label_dtype"] == "int64" and info["num_classes"] == 64
    assert {s: v["num_samples"] for s, v in info["splits"].items()} == {"train": 640, "val": 128, "test": 128}

    idx = [7, 0, 639, 7]
    x, y = arrays(client.request(BatchRequest(dataset="tok", split="train", frames=[np.asarray(idx, "<i8").tobytes()])))
    assert x.shape == (4, 33) and x.dtype == np.uint16 and y.shape == (4, 0)
    assert x.max() < 64 and np.array_equal(x[0], x[3])
    # a sequence is the same whichever batch asks for it, and in a fresh source built from the URI
    fresh = open_source(TOKENS)
    assert np.array_equal(x, fresh.read("train", np.array(idx))[0])
    ranged, _ = arrays(client.request(BatchRequest(dataset="tok", split="train", range=[0, 8])))
    assert np.array_equal(ranged[0], x[1]) and np.array_equal(ranged[7], x[0])
    val, _ = arrays(client.request(BatchRequest(dataset="tok", split="val", range=[0, 8])))
    assert not np.array_equal(val, ranged)  # splits are different data
    assert not np.array_equal(open_source(TOKENS + "&seed=1").read("train", np.arange(8))[0], ranged)


def test_mock_tokens_have_structure_a_model_can_learn():
    source = open_source("mock://tokens?n=2000&seq_len=64&vocab=128")
    x, _ = source.read("train", np.arange(2000))
    prev, nxt = x[:, :-1].ravel().astype(np.int64), x[:, 1:].ravel().astype(np.int64)
    counts = np.zeros((128, 128))
    np.add.at(counts, (prev, nxt), 1)
    # every token's likeliest successor follows it about half the time (1/128 if there were no structure)
    top_share = counts.max(1).sum() / counts.sum()
    assert 0.4 < top_share < 0.6
    assert source.entropy_per_token < math.log(128) - 2.5


def test_large_vocabularies_use_four_byte_tokens_and_reads_are_fast():
    wide = open_source("mock://tokens?n=10&seq_len=8&vocab=70000")
    x, _ = wide.read("val", np.arange(2))
    assert x.dtype == np.uint32 and wide.info()["dtype"] == "uint32" and x.max() < 70000
    source = open_source("mock://tokens")
    indices = np.random.default_rng(0).integers(0, source.num_samples("train"), 256)
    source.read("train", indices)
    started = time.perf_counter()
    for _ in range(10):
        x, _ = source.read("train", indices)
    assert x.shape == (256, 65)
    assert (time.perf_counter() - started) / 10 < 0.02  # ~2 ms here; generous for a loaded machine


@pytest.mark.parametrize(
    "query, words",
    [
        ("n=0", "n must be at least 1"),
        ("vocab=1", "vocab must be between"),
        ("seq_len=0", "seq_len"),
        ("noise=1.5", "noise is a probability"),
        ("noise=lots", "'noise' must be a number"),
        ("seq_len=long", "'seq_len' must be an integer"),
        ("colour=red", "unknown parameter"),
    ],
)
def test_bad_mock_token_parameters_are_named(query, words):
    with pytest.raises(DatasetError, match=words):
        open_source(f"mock://tokens?{query}")


def test_tiny_lm_is_causal_and_shaped_by_the_dataset():
    info = open_source(TOKENS).info()
    torch.manual_seed(0)
    model = build_model("tiny-lm", info).eval()
    tokens = torch.randint(0, 64, (3, 32))
    with torch.no_grad():
        logits = model(tokens)
        assert logits.shape == (3, 32, 64)
        changed = tokens.clone()
        changed[:, 20] = (changed[:, 20] + 1) % 64
        after = model(changed)
    # positions before the change see nothing of it; the changed position and later ones do
    assert torch.allclose(logits[:, :20], after[:, :20], atol=1e-5)
    assert not torch.allclose(logits[:, 20:], after[:, 20:], atol=1e-3)
    with pytest.raises(ValueError, match="at most 32 tokens"):
        model(torch.zeros((1, 33), dtype=torch.long))


def test_models_refuse_datasets_of_the_wrong_kind():
    tokens, images = open_source(TOKENS).info(), open_source("mock://mnist?n=10").info()
    with pytest.raises(BadRequest, match="needs a token dataset"):
        build_model("tiny-lm", images)
    for name in ("mlp", "cnn"):
        with pytest.raises(BadRequest, match="use model 'tiny-lm'"):
            build_model(name, tokens)


def test_token_evaluation_scores_every_next_token_and_counts_sequences():
    source = open_source(TOKENS)
    torch.manual_seed(0)
    model = build_model("tiny-lm", source.info())
    x, y = (torch.from_numpy(a) for a in source.read("val", np.arange(10)))
    loss, accuracy, n = evaluate(model, [(x[:4], y[:4]), (x[4:], y[4:])], "tokens")
    with torch.no_grad():
        logits = model.eval()(x[:, :-1].long())
    targets = x[:, 1:].long()
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1)).item()
    assert n == 10 and loss == pytest.approx(want, rel=1e-5)
    assert accuracy == pytest.approx((logits.argmax(-1) == targets).float().mean().item())


def test_a_job_trains_tiny_lm_on_mock_tokens_and_its_loss_falls(router, start_provider, trainer, client_for):
    provider = start_provider(f"tok={TOKENS}", assigned_only=True)
    admin = client_for(router.endpoint, role="admin")
    job = admin.request(
        SubmitJob(spec={"dataset": "tok", "model": "tiny-lm", "epochs": 3, "batch_size": 32, "lr": 0.003, "seed": 0})
    ).job
    info = wait_job(admin, job, timeout=60)
    assert info["state"] == "succeeded", info.get("error")
    result = info["result"]
    history = result["history"]
    log_vocab, best = math.log(64), open_source(TOKENS).entropy_per_token  # 4.16 and 1.78 nats
    print(
        f"tiny-lm on {TOKENS}: log(vocab) {log_vocab:.3f}, chain entropy {best:.3f}, "
        f"first-epoch train loss {history[0]['train_loss']:.3f}, val losses "
        f"{[round(e['val_loss'], 3) for e in history]}, test loss {result['test_loss']:.3f}"
    )
    assert len(history) == 3
    # an untrained model scores about log(vocab); a trained one approaches the chain's entropy
    assert history[0]["train_loss"] > result["val_loss"] + 0.3
    assert history[-1]["val_loss"] < history[0]["val_loss"] - 0.1
    assert result["val_loss"] < log_vocab - 1.5 and result["val_loss"] < best + 0.4
    assert result["val_perplexity"] == pytest.approx(math.exp(result["val_loss"]))
    assert result["val_accuracy"] > 0.3  # the likeliest successor comes half the time, less noise
    # the provider scored the final weights on its private test split, with the same next-token loss
    assert result["test_n"] == 128 and abs(result["test_loss"] - result["val_loss"]) < 0.2
    assert provider.service.handler.served["tok"]["evaluations"] == 1


def test_a_classifier_on_a_token_dataset_fails_saying_why(router, start_provider, trainer, client_for):
    start_provider(f"tok={TOKENS}")
    admin = client_for(router.endpoint, role="admin")
    job = admin.request(SubmitJob(spec={"dataset": "tok", "model": "mlp", "epochs": 1})).job
    info = wait_job(admin, job, timeout=30)
    assert info["state"] == "failed" and "use model 'tiny-lm'" in info["error"]
