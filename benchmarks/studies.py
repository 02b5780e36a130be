"""Studies at full size, on real processes (``busctl start`` router, provider, trainers on loopback):

- ``asha``: a 12-trial study (TPE sampler, ASHA pruner) on two trainers; the router is killed -9
  mid-study and started again on the same address; prints every trial, the best, and the epochs
  trained against the epochs of running every trial to the end.
- ``pbt``: population-based training against random search with the same budget (population =
  trials, the same epochs each) on a noisy mock where a high learning rate early and a low one
  late wins; prints both best scores and the seeds.

    .venv/bin/python -m benchmarks.studies asha
    .venv/bin/python -m benchmarks.studies pbt --seeds 0 1 2   # mock mnist n=10000 noise=6, 4 x 6 epochs
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from libbus.connect.client import Client, Identity
from libbus.security.auth import ensure_secret, issue_token
from libbus.wire.messages import GetJob, GetStudy, SubmitStudy
from services.router.study_store import StudyState, TrialState

BUSCTL = [str(Path(sys.executable).with_name("busctl"))]


class Cluster:
    """Router, one provider and ``trainers`` trainers sharing a state directory (and so their
    checkpoints, which PBT copies between trainers)."""

    def __init__(self, state: Path, dataset: str, trainers: int):
        self.state = state
        ensure_secret(state / "secret")
        self.env = {
            **os.environ,
            "BATCHBUS_STATE_DIR": str(state),
            "BATCHBUS_TORCH_THREADS": "1",
            "BATCHBUS_PROGRESS_INTERVAL_S": "0.5",
            "BATCHBUS_LEASE_S": "10",
        }
        self.procs: dict[str, subprocess.Popen] = {}
        self.endpoint = self.start_router("tcp://127.0.0.1:0")
        self.start("provider", "provider", "--dataset", dataset)
        for i in range(trainers):
            self.start(f"trainer-{i}", "trainer")
        token = issue_token(
            (state / "secret").read_bytes().strip(), sub="bench", role="admin", audience="batchbus", ttl_s=7200
        )
        self.admin = Client(self.endpoint, Identity(role="admin", name="bench", token=token), timeout_s=10, retries=3)

    def start(self, name: str, role: str, *args: str) -> None:
        with open(self.state / f"{name}.log", "a") as log:
            self.procs[name] = subprocess.Popen(
                [*BUSCTL, "start", role, "--name", name, *args], env=self.env, stdout=log, stderr=subprocess.STDOUT
            )

    def start_router(self, bind: str) -> str:
        ready = self.state / "router.ep"
        ready.unlink(missing_ok=True)
        self.start("router", "router", "--bind", bind, "--ready-file", str(ready))
        deadline = time.monotonic() + 60
        while not ready.exists():
            if time.monotonic() > deadline or self.procs["router"].poll() is not None:
                raise SystemExit(f"router did not start; see {self.state}/router.log")
            time.sleep(0.05)
        endpoint = ready.read_text().strip()
        self.env["BATCHBUS_ROUTER"] = endpoint
        return endpoint

    def kill_router(self) -> None:
        self.procs["router"].send_signal(signal.SIGKILL)
        self.procs["router"].wait()

    def study(self, study: str) -> dict:
        return self.admin.request(GetStudy(study=study)).study

    def run_study(self, raw: dict, timeout: float, on_poll=None) -> dict:
        study = self.admin.request(SubmitStudy(spec=raw)).study["id"]
        deadline = time.monotonic() + timeout
        while True:
            info = self.study(study)
            if info["state"] != StudyState.RUNNING:
                return info
            if on_poll is not None:
                on_poll(info)
            if time.monotonic() > deadline:
                raise SystemExit(f"study {study} did not finish in {timeout} s; logs in {self.state}")
            time.sleep(0.5)

    def close(self) -> None:
        self.admin.close()
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def show(info: dict) -> None:
    print(
        f"study {info['id']} {info['state']}: epochs trained {info['epochs_trained']} of "
        f"{info['epochs_budget']} ({100 * info['epochs_trained'] / info['epochs_budget']:.0f}%)"
    )
    for t in info["trials"]:
        value = f"{t['value']:.4f}" if t["value"] is not None else "-"
        params = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in t["params"].items())
        print(f"  {t['number']:>2} {t['job']} {t['state']:<8} {value:>7} {t['epochs']:>5} epochs  {params}")
    best = info["best"]
    print(f"  best: trial {best['number']} {info['objective']} {best['value']:.4f}" if best else "  best: none")


def asha(args) -> None:
    with tempfile.TemporaryDirectory(prefix="bb-asha-") as tmp:
        cluster = Cluster(Path(tmp), "mnist=mock://mnist?n=2000&noise=3", trainers=2)
        killed: list[float] = []

        def maybe_kill(info: dict) -> None:
            ended = sum(
                t["state"] in (TrialState.PRUNED, TrialState.COMPLETE, TrialState.FAILED) for t in info["trials"]
            )
            if not killed and ended >= 5:
                print(f"kill -9 the router with {ended} trials ended, {len(info['trials'])} started")
                down = time.monotonic()
                cluster.kill_router()
                time.sleep(1.0)
                cluster.start_router(cluster.endpoint)
                killed.append(time.monotonic())
                print(f"router back after {killed[0] - down:.1f} s (trainers trained on meanwhile)")

        try:
            raw = {
                "base": {
                    "dataset": "mnist",
                    "model": "mlp",
                    "model_kwargs": {"hidden": 64},
                    "epochs": 6,
                    "batch_size": 32,
                    "optimizer": "sgd",
                    "evaluate": False,
                    "seed": args.seed,
                },
                "space": {"lr": {"log_uniform": [1e-4, 0.3]}, "momentum": {"uniform": [0.0, 0.95]}},
                "study": {
                    "trials": 12,
                    "concurrent": 2,
                    "objective": "val_accuracy",
                    "sampler": "tpe",
                    "pruner": "asha",
                    "reduction_factor": args.rf,
                    "seed": args.seed,
                },
            }
            started = time.monotonic()
            info = cluster.run_study(raw, timeout=1200, on_poll=maybe_kill)
            print(f"seed {args.seed}; {time.monotonic() - started:.0f} s; router killed: {bool(killed)}")
            show(info)
        finally:
            cluster.close()


def pbt_vs_random(args) -> None:
    base = {
        "dataset": "noisy",
        "model": "mlp",
        "model_kwargs": {"hidden": 64},
        "epochs": args.epochs,
        "batch_size": 32,
        "optimizer": "sgd",
        "momentum": args.momentum,
        "evaluate": False,
    }
    space = {"lr": {"log_uniform": args.lr}}
    with tempfile.TemporaryDirectory(prefix="bb-pbt-") as tmp:
        cluster = Cluster(Path(tmp), f"noisy=mock://mnist?n={args.n}&noise={args.noise}", trainers=args.population)
        try:
            for seed in args.seeds:
                results = {}
                for strategy in ("search", "pbt"):
                    raw = {
                        "base": {**base, "seed": seed},
                        "space": space,
                        "study": {
                            "trials": args.population,
                            "concurrent": args.population,
                            "sampler": "random",
                            "strategy": strategy,
                            "seed": seed,
                            "interval": 1,
                            "quantile": args.quantile,
                            "perturb": args.perturb,
                        },
                    }
                    info = cluster.run_study(raw, timeout=1800)
                    print(f"seed {seed}, {'random search' if strategy == 'search' else 'PBT'}:")
                    show(info)
                    if strategy == "pbt":
                        events = [
                            e["reason"]
                            for t in info["trials"]
                            for e in cluster.admin.request(GetJob(job=t["job"])).job["events"]
                        ]
                        print(
                            f"  exploit steps {sum(r.startswith('pbt exploit') for r in events)}, adopted "
                            f"{sum(r.startswith('adopt acknowledged') for r in events)}, explore steps "
                            f"{sum(r.startswith('pbt explore') for r in events)}"
                        )
                    results[strategy] = info["best"]["value"] if info["best"] else float("nan")
                print(
                    f"seed {seed}: best val_accuracy random {results['search']:.4f}, PBT {results['pbt']:.4f} "
                    f"({'PBT' if results['pbt'] > results['search'] else 'random'} wins), same budget "
                    f"{args.population} x {args.epochs} epochs"
                )
        finally:
            cluster.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    a = sub.add_parser("asha")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--rf", type=int, default=3, help="ASHA's reduction factor")
    p = sub.add_parser("pbt")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--population", type=int, default=4)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--noise", type=float, default=6.0)
    p.add_argument("--n", type=int, default=10000, help="training samples of the mock")
    p.add_argument("--lr", type=float, nargs=2, default=[1e-3, 0.3], help="the log-uniform range of lr")
    p.add_argument("--perturb", type=float, nargs="+", default=[0.5, 2.0], help="PBT's explore factors")
    p.add_argument("--quantile", type=float, default=0.5)
    args = parser.parse_args()
    asha(args) if args.what == "asha" else pbt_vs_random(args)


if __name__ == "__main__":
    main()
