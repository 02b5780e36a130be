"""Training functions submitted as entrypoint jobs by the tests (tests/trainer/test_entrypoints.py): one with
its own loss, written as a user would from docs/jobs.md, and ones that crash, exhaust memory, hang
or exit, each of which must fail only its own attempt."""

from __future__ import annotations

import ctypes
import logging
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

from libbus.jobapi import Job


def smoothed_cross_entropy(logits: torch.Tensor, target: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Label-smoothed cross-entropy, by hand: a loss the built-in loop does not have."""
    logp = F.log_softmax(logits, dim=1)
    nll = -logp.gather(1, target[:, None]).squeeze(1)
    return ((1 - smoothing) * nll - smoothing * logp.mean(dim=1)).mean()


def custom_loss(job: Job) -> None:
    torch.manual_seed(job.params.get("seed", 0))
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=job.params["lr"], momentum=0.9)
    job.on_checkpoint(lambda: {"model": model, "optimizer": optimizer})
    state = job.restore()
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    train, val = job.loader("train"), job.loader("val")
    print(f"attempt {job.attempt}: epoch {train.epoch} from sample {train.position}", flush=True)
    for epoch in range(train.epoch, job.params["epochs"]):
        model.train()
        for x, y in train:
            loss = smoothed_cross_entropy(model(x.float() / 255), y.long(), job.params.get("smoothing", 0.1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            for group in optimizer.param_groups:  # busctl job set lr=... applies from the next step
                group["lr"] = job.params["lr"]
            job.step(loss=loss.item())
        model.eval()
        total, correct, n = 0.0, 0, 0
        with torch.no_grad():
            for x, y in val:
                logits = model(x.float() / 255)
                total += F.cross_entropy(logits, y.long(), reduction="sum").item()
                correct += (logits.argmax(1) == y.long()).sum().item()
                n += len(y)
        print(f"epoch {epoch + 1}: val accuracy {correct / n:.3f}", flush=True)
        job.report(val_loss=total / n, val_accuracy=correct / n)
    job.save_model(model.state_dict())


def segfault(job: Job) -> None:
    print("about to read address 0", flush=True)
    ctypes.string_at(0)


def hog(job: Job) -> None:
    """Allocates until the kernel's out-of-memory killer ends it (the test runs it in a memory cgroup)."""
    print("allocating", flush=True)
    held = []
    while True:
        held.append(torch.ones(16 << 20, dtype=torch.uint8))  # 16 MiB at a time, touched


def hang(job: Job) -> None:
    print("waiting forever \x1b[2J", flush=True)  # an escape sequence busctl must not pass on to a terminal
    logging.getLogger("user.job").warning("stuck before step %d", 1)  # a log record, kept with its level and logger
    while True:
        time.sleep(3600)


def exits(job: Job) -> None:
    sys.exit(3)


def stoppable(job: Job) -> None:
    """Steps forever (slowly) until stopped; checkpoints its step count."""
    state = job.restore() or {"n": 0}
    n = state["n"]
    job.on_checkpoint(lambda: {"n": n})
    while True:
        n += 1
        time.sleep(0.05)
        job.step()


def counter(job: Job) -> None:
    """Adds ``params["delta"]`` (which ``busctl job set`` may change) once a step, for
    ``params["steps"]`` steps; its state is the count and the total."""
    state = job.restore() or {"n": 0, "total": 0.0}
    n, total = state["n"], state["total"]
    print(f"counter starts at n={n} total={total}", flush=True)
    job.on_checkpoint(lambda: {"n": n, "total": total})
    while n < job.params["steps"]:
        time.sleep(0.02)
        n += 1
        total += job.params["delta"]
        job.step(loss=float(job.params["delta"]))
        if n % 50 == 0:
            job.report(val_loss=1.0 / n)
    job.save_model({"n": torch.tensor(n), "total": torch.tensor(total)})


def parabola(job: Job) -> None:
    """A function a study tunes: its val_loss falls each epoch towards (x - 0.3)², so trials with x
    far from 0.3 are worse at every epoch (a pruner can tell early)."""
    x = job.params["x"]
    for epoch in range(job.epochs_reported, job.params.get("epochs", 4)):
        time.sleep(0.02)
        job.step(loss=x)
        job.report(val_loss=(x - 0.3) ** 2 + 1.0 / (epoch + 1))
    job.save_model({"x": torch.tensor(x)})


def ddp(job: Job) -> None:
    """DistributedDataParallel over the job's gang (torch.distributed is initialized for the function)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.ReLU(), nn.Linear(16, 10))
    net = DistributedDataParallel(model) if job.world_size > 1 else model
    optimizer = torch.optim.SGD(model.parameters(), lr=job.params["lr"], momentum=0.9)
    job.on_checkpoint(lambda: {"model": model, "optimizer": optimizer})
    state = job.restore()  # every rank: rank 0 reads the checkpoint, every rank restores the same
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    train = job.loader("train")
    for epoch in range(train.epoch, job.params["epochs"]):
        loss = torch.zeros(())
        for x, y in train:
            loss = F.cross_entropy(net(x.float() / 255), y.long())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            time.sleep(job.params.get("sleep", 0.0))
            job.step(loss=loss.item())
        print(f"rank {job.rank} of {job.world_size}: epoch {epoch} tag {job.params.get('tag')}", flush=True)
        job.report(val_loss=loss.item())
    job.save_model(model.state_dict())


def ids_seen(job: Job) -> None:
    """Saves the ids (first feature) of every train sample it was given, epoch by epoch."""
    train = job.loader("train", batch_size=7)
    seen = {}
    for epoch in range(job.params.get("epochs", 2)):
        seen[f"epoch{epoch}"] = torch.cat([x[:, 0] for x, _ in train]).to(torch.int64)
        job.report(val_loss=0.0)
    job.save_model(seen)


def constant(job: Job) -> None:
    """Its model is ``params["value"]``, or where it starts from (``model_from``) plus one."""
    start = job.initial_model()
    w = start["w"] + 1 if start is not None else torch.full((3,), float(job.params.get("value", 0.0)))
    job.save_model({"w": w})


class _Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))


def counting(job: Job) -> None:
    """Its model (a module with one weight ``w``) counts its steps: ``w`` is the step count at each
    checkpoint (taken when asked: ``busctl job checkpoint``); ``params["steps"]`` steps of
    ``params["sleep"]`` s. A job starting from it (``constant``) ends with ``w`` + 1."""
    model = _Counter()
    state = job.restore()
    if state is not None:
        model.load_state_dict(state["model"])
    job.on_checkpoint(lambda: {"model": model})
    for _ in range(int(model.w[0]), job.params.get("steps", 1000)):
        with torch.no_grad():
            model.w += 1
        time.sleep(job.params.get("sleep", 0.05))
        job.step()
    job.save_model(model.state_dict())


def pbt_member(job: Job) -> None:
    """Its state is one number ``w``, raised by ``params["rate"]`` each epoch; the closer to 20, the
    better (a member with a small rate is the bottom one, and takes a better member's ``w``)."""
    state = job.restore() or {"w": torch.zeros(())}
    w = state["w"]
    job.on_checkpoint(lambda: {"w": w})
    print(f"attempt {job.attempt} starts at epoch {job.epochs_reported} with w {float(w):g}", flush=True)
    for _ in range(job.epochs_reported, job.params["epochs"]):
        w = w + job.params["rate"]
        time.sleep(0.05)
        job.step()
        job.report(val_loss=float((w - 20) ** 2))
    job.save_model({"w": w})


def linear_classifier(job: Job) -> None:
    """Trains a linear classifier (``weight``, ``bias``: a model no built-in names) with its own loop;
    the provider's operator-installed evaluator (tests/support/evaluators.py:linear) scores it."""
    torch.manual_seed(0)
    weight = torch.zeros(10, 784, requires_grad=True)
    bias = torch.zeros(10, requires_grad=True)
    optimizer = torch.optim.SGD([weight, bias], lr=0.1)
    for x, y in job.loader("train"):
        loss = F.cross_entropy(x.reshape(len(x), -1).float() @ weight.T + bias, y.long())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        job.step(loss=loss.item())
    job.report(val_loss=loss.item())
    job.save_model({"weight": weight.detach(), "bias": bias.detach()})


def recorded(job: Job) -> None:
    """Trains as :func:`custom_loss` does (one ``job.step()`` per train batch) and appends the digest
    of every sample of each step to ``params["out"]/<attempt>.jsonl`` (first line: the step it
    resumed from), for tests/router/test_samples_of_each_step.py to compare with ``busctl job samples``."""
    import json
    from pathlib import Path

    from services.trainer.attempt.audit import digest

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    done = {"steps": 0}
    job.on_checkpoint(lambda: {"model": model, "optimizer": optimizer, "steps": done["steps"]})
    state = job.restore()
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        done["steps"] = int(state["steps"])
    train = job.loader("train")
    with open(Path(job.params["out"]) / f"{job.attempt}.jsonl", "a") as out:
        out.write(json.dumps({"resumed_from_step": done["steps"]}) + "\n")
        for _ in range(train.epoch, job.params["epochs"]):
            for x, y in train:
                loss = F.cross_entropy(model(x.float() / 255), y.long())
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                done["steps"] += 1
                xs, ys = x.numpy(), y.numpy()
                out.write(
                    json.dumps(
                        {
                            "step": done["steps"],
                            "samples": [digest(xs[i].tobytes(), ys[i].tobytes()) for i in range(len(xs))],
                        }
                    )
                    + "\n"
                )
                out.flush()
                job.step(loss=loss.item())
            job.report(val_loss=1.0)
    job.save_model(model.state_dict())


def linear_until_stopped(job: Job) -> None:
    """:func:`linear_classifier`, with its state registered (``model``: the weight and bias) and
    epochs until it is stopped: a running entrypoint job for ``busctl job eval`` and ``job model
    --current``, scored by tests/support/evaluators.py:linear."""
    torch.manual_seed(0)
    weight = torch.zeros(10, 784, requires_grad=True)
    bias = torch.zeros(10, requires_grad=True)
    optimizer = torch.optim.SGD([weight, bias], lr=0.1)
    job.on_checkpoint(lambda: {"model": {"weight": weight, "bias": bias}, "optimizer": optimizer})
    train = job.loader("train")
    for _ in range(job.params.get("epochs", 10**6)):
        for x, y in train:
            loss = F.cross_entropy(x.reshape(len(x), -1).float() / 255 @ weight.T + bias, y.long())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            job.step(loss=loss.item())


def misuse(job: Job) -> None:
    """Makes each wrong call a user could make of the job API and checks it is refused with a
    ``BadRequest`` saying what is wrong, and counts nothing; prints each refusal; then trains one step."""
    from libbus.errors import BadRequest

    checks = [
        (lambda: job.step(samples=-1), "samples is the step's batch size"),
        (lambda: job.step(samples="64"), "samples is the step's batch size"),  # type: ignore[arg-type]
        (lambda: job.step(loss="low"), "'loss' must be a number"),  # type: ignore[arg-type]
        (lambda: job.report(epoch=3), "metric names are identifiers other than 'epoch'"),
        (lambda: job.report(val_loss=[1.0]), "'val_loss' must be a number"),  # type: ignore[arg-type]
        (lambda: job.loader("train", dataset="other"), "dataset are the job's own"),
        (lambda: job.checkpoint(), "needs the state to store"),
        (lambda: job.on_checkpoint(42), "needs a function"),  # type: ignore[arg-type]
        (lambda: job.checkpoint({"handle": object()}), "state at state['handle'] is a object"),
    ]
    for call, says in checks:
        try:
            call()
        except BadRequest as err:
            if says not in str(err):
                raise AssertionError(f"refused, but {str(err)!r} does not say {says!r}") from err
            print(f"refused: {err}", flush=True)
        else:
            raise AssertionError(f"accepted a call that should say {says!r}")
    if (job.step_count, job.epochs_reported, job.history) != (0, 0, []):
        raise AssertionError(f"a refused call counted: {job.step_count} steps, {job.history}")
    job.step(loss=1.0, samples=3)
    job.save_model({"w": torch.zeros(1)})


def threads(job: Job) -> None:
    """Prints the torch threads its attempt runs with (the trainer's ``torch_threads``)."""
    print(f"torch threads {torch.get_num_threads()}", flush=True)
    job.save_model({"w": torch.zeros(1)})


def checkpoints_fast(job: Job) -> None:
    """A checkpoint at every step, a few ms apart, for ``params["steps"]`` steps: an attempt that
    outlives its killed trainer for even tens of ms writes several more after the one the router
    took. Prints where each attempt starts."""
    state = job.restore() or {"n": 0}
    print(f"attempt {job.attempt} starts at n={state['n']} step {job.step_count}", flush=True)
    n = int(state["n"])
    while n < job.params["steps"]:
        n += 1
        job.step()
        job.checkpoint({"n": n})
        time.sleep(0.002)
    job.save_model({"n": torch.tensor([float(n)])})


def loud(job: Job) -> None:
    """Prints, in one burst, a line of 300,000 Cyrillic characters, 1.1 MB of Cyrillic (250 lines of
    3,000 characters, 2 bytes each in a message), and 100 lines of 3,000 control characters (6 bytes
    each in a message, and in no newline at the end); then ends well. Its output must cost no service anything."""
    sys.stdout.write("Я" * 300_000 + "\n")
    sys.stdout.write(("Ж" * 3000 + "\n") * 250)
    sys.stdout.write("\n".join(["\x01" * 3000] * 100))
    sys.stdout.flush()
    job.save_model({"w": torch.zeros(1)})


def _proc_cmdline(pid: int | str) -> list[str]:
    """Another process's arguments as /proc shows them ([] where they may not be read)."""
    try:
        raw = open(f"/proc/{pid}/cmdline", "rb").read()  # noqa: SIM115 - one read
    except OSError:
        return []
    return [arg.decode(errors="replace") for arg in raw.split(b"\0") if arg]


def _proc_environ(pid: int | str) -> dict[str, str]:
    """Another process's environment as /proc shows it ({} where it may not be read)."""
    try:
        raw = open(f"/proc/{pid}/environ", "rb").read()  # noqa: SIM115 - one read
    except OSError:
        return {}
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw.split(b"\0") if item)


def _parent_of(pid: int) -> int:
    try:
        return int(open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[1])  # noqa: SIM115 - one read
    except (OSError, ValueError, IndexError):
        return 0


def hostile(job: Job) -> None:
    """A tenant's function that tries to act as its trainer (tests/security/test_attempt_grant.py): it looks for
    a credential of its trainer in its settings, its environment and arguments and its parents' (and in
    every file those name), says Hello to the router as a trainer with each token it holds and asks for a task
    (with its trainer's pid and host id, as the one-process-per-subject rule takes them), reads
    ``params["victim"]`` (another tenant's dataset) from its provider, then reads its own train split.
    It writes what it got to ``params["out"]`` (JSON) once ``params["go"]`` exists."""
    import json
    import os
    import re
    from pathlib import Path

    from libbus.connect.client import Client, Identity
    from libbus.errors import BusError
    from libbus.loader.remote import RemoteLoader
    from libbus.security.auth import inspect_token
    from libbus.wire.messages import GetTask

    deadline = time.monotonic() + 50
    while not Path(job.params["go"]).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    out: dict = {"credentials": [], "router": [], "victim": "", "own_batches": 0}
    settings = getattr(job, "settings", None)
    grant = job.identity.current_token()  # type: ignore[attr-defined]  # AttemptJob's
    grant_role = inspect_token(grant)[1].get("role", "")
    trainer_pid = _parent_of(_parent_of(os.getpid()) or os.getppid())
    texts: list[tuple[str, str]] = []
    values = {
        f: str(getattr(settings, f, "") or "") for f in ("token", "token_file", "secret_file", "signing_key_file")
    }
    envs = {"self": dict(os.environ)}
    for who, pid in (("/proc/self", "self"), ("parent", os.getppid()), ("trainer", trainer_pid)):
        envs[who] = _proc_environ(pid)
    texts += [(f"settings.{k}", v) for k, v in values.items()]
    texts += [(f"{who} env {k}", v) for who, env in envs.items() for k, v in env.items()]
    for who, pid in (("self", "self"), ("parent", os.getppid()), ("trainer", trainer_pid)):  # and arguments
        texts += [(f"{who} argument {i}", arg) for i, arg in enumerate(_proc_cmdline(pid))]
    for where, value in list(texts):
        if value.startswith("/") and len(value) < 4096:  # a file a setting or variable names
            try:
                path = Path(value)
                files = [p for p in path.iterdir() if p.is_file()] if path.is_dir() else [path]
                texts += [(f"{where} -> {p}", p.read_text(errors="replace")[:100_000]) for p in files]
            except OSError:
                pass
    tokens = {}
    for where, text in texts:
        for tok in re.findall(r"eyJ[\w-]+\.eyJ[\w-]+\.[\w-]+", text):
            try:
                claims = inspect_token(tok)[1]
            except Exception:  # noqa: BLE001 - not a token
                continue
            if claims.get("role") != "attempt":  # its own grant aside: anything else is its trainer's
                tokens[tok] = claims.get("role", "")
                out["credentials"].append(f"{where}: a {claims.get('role')} token of {claims.get('sub')!r}")
        if "-> " in where and ("secret" in where or "BEGIN PRIVATE KEY" in text):
            out["credentials"].append(f"{where}: {len(text)} bytes of key material")

    class Spoofed(Identity):
        def hello(self, *args, **kwargs):  # the trainer's pid, as the audit's probe said it
            msg = super().hello(*args, **kwargs)
            msg.pid = trainer_pid
            return msg

    router = str(getattr(settings, "router", ""))
    for tok, role in [(grant, grant_role), (grant, "trainer"), *tokens.items()]:
        client = Client(
            router,
            Spoofed(role=role, name=job.identity.name, token=tok, host_id=job.identity.host_id),  # type: ignore[attr-defined]
            timeout_s=5,
            retries=0,
        )
        try:
            reply = client.request(GetTask(key="hostile"))
            out["router"].append(f"{role}: {type(reply).__name__} {getattr(reply, 'job', '')}")
        except BusError as err:  # what the router said
            out["router"].append(f"{role}: refused {type(err).__name__}: {err}")
        except Exception as err:  # noqa: BLE001 - the probe broke: the router was never asked
            out["router"].append(f"{role}: not asked, {type(err).__name__}: {err}")
        finally:
            client.close()
    provider = job.provider  # type: ignore[attr-defined]  # AttemptJob's
    try:
        victim = RemoteLoader(
            job.params["victim"],
            provider=[provider],
            token=grant,
            batch_size=8,
            retries=0,
            timeout_s=5,
            provider_wait_s=0,
            shm=False,
        )
        x, _ = next(iter(victim))
        out["victim"] = f"read {len(x)} samples"
        victim.close()
    except Exception as err:  # noqa: BLE001 - what the provider said
        out["victim"] = f"refused {type(err).__name__}: {err}"
    for _ in job.loader("train"):
        out["own_batches"] += 1
        job.step()
        if out["own_batches"] == 3:
            break
    Path(job.params["out"]).write_text(json.dumps(out))


def known_losses(job: Job) -> None:
    """Two epochs of its train loader with loss ``1 / n`` at its ``n``-th step and ``val_loss`` ``0.5 / E``
    at epoch ``E``: figures a reader of its metrics can check at their steps. No ``epochs`` param:
    its displays know only the epochs it reports."""
    train, n = job.loader("train"), 0
    for epoch in range(2):
        for _ in train:
            n += 1
            time.sleep(0.03)  # several progress reports an epoch (the cluster's progress_interval_s is 0.1)
            job.step(loss=1.0 / n)
        job.report(val_loss=0.5 / (epoch + 1))
    job.save_model({"n": torch.tensor(n)})


def stuck_in_c(job: Job) -> None:
    """Three steps, then a C call that holds the GIL for an hour: no thread of its process runs, so it
    does not notice its trainer's end (a stuck collective or driver call looks like this)."""
    for _ in range(3):
        time.sleep(0.15)  # each step reported (the test cluster's progress_interval_s is 0.1)
        job.step()
    print("entering the C call", flush=True)
    ctypes.PyDLL(None).sleep(3600)


def _linear_weights(fill: float) -> dict[str, torch.Tensor]:
    """Weights for tests/support/evaluators.py:linear (no training: the tests score who sent what)."""
    return {"weight": torch.full((10, 784), fill), "bias": torch.zeros(10)}


def swaps_model_after_save(job: Job) -> None:
    """Saves its final model, then writes other weights over the file before it returns (before the
    final scoring): the weights scored would not be those it saved."""
    from safetensors.torch import save_file

    record = job.save_model(_linear_weights(0.0))
    save_file(_linear_weights(0.01), record["path"])


def scores_other_weights(job: Job) -> None:
    """Saves one model and has other weights scored: its code runs in the attempt's process, so it
    replaces the attempt's scoring with one that sends the provider other bytes than it hands back."""
    from safetensors.torch import save

    child = sys.modules["services.trainer.attempt.child"]
    real, other = child._scored, save(_linear_weights(0.01))
    child._scored = lambda attempt, blob, *rest: real(attempt, other, *rest)
    job.save_model(_linear_weights(0.0))


def probes_files(job: Job) -> None:
    """Tries to read each file of ``params["probe"]`` (name -> path) and to list ``params["list"]``,
    leaves a process running behind it, trains three steps with a checkpoint, saves its model, and
    writes what it found (its uid and groups, each probe's outcome, the leftover's pid) to ``params["out"]``."""
    import json
    import os
    import subprocess
    from pathlib import Path

    found: dict = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "probes": {}}
    for name, path in {**job.params["probe"], "listing": job.params["list"]}.items():
        try:
            if name == "listing":
                os.listdir(path)
            else:
                with open(path, "rb") as f:
                    f.read(1)
            found["probes"][name] = "read"
        except OSError as err:
            found["probes"][name] = type(err).__name__
    leftover = subprocess.Popen(["sleep", "600"], start_new_session=True, stdin=subprocess.DEVNULL)
    found["leftover"] = leftover.pid
    model = nn.Linear(784, 10)
    for n, (x, y) in enumerate(job.loader("train"), 1):
        F.cross_entropy(model(x.reshape(len(x), -1).float()), y.long()).backward()
        job.step()
        if n == 3:
            break
    found["checkpoint"] = job.checkpoint({"model": model.state_dict()})["path"]
    found["model"] = job.save_model(model.state_dict())["path"]
    Path(job.params["out"]).write_text(json.dumps(found))
