"""Decode once for a whole study: a provider's CPU for four concurrent jobs on one image dataset, with and
without its decode cache, against one job (docs/performance.md, "Four jobs, one decode").

Generated JPEGs of realistic size (500×375, quality 90, ~125 KB: benchmarks/images.py's) in an ImageFolder
tree; a real router and provider (``busctl start``), and four ``RemoteLoader`` s with seeds 0..3 (four trials
of a study: each its own order) reading one epoch of the train split at once, same-host (shared memory).
The unit is the provider process's CPU seconds (user + system, /proc), from its first request to the last
job's end; every row starts a fresh provider. Each recipe runs:

- ``one``: one job, no cache (today's cost of a job);
- ``one_cached``: one job, cache on (what the cache costs a job that gains nothing from it);
- ``four``: four jobs, no cache (each decodes every image: about 4×);
- ``four_cached``: four jobs, cache on (``decode_cache_bytes`` holds the decoded dataset and the final
  outputs). A pipeline's random stages draw from the pipeline's seed, the request's epoch and the index,
  never from the job's seed (which orders its samples): four jobs in one epoch share the final outputs.

and ``imagenet-train`` also (the crop that resamples, the case that matters):

- ``four_same_seed_cached``: four jobs with seed 0 (trials keeping the study's seed: one order too);
- ``four_epochs`` / ``four_epochs_cached``: job k reads epoch k, so each job's crops and flips are its
  own and only the decode is shared (the cache before final outputs were kept, and jobs of a study that
  run an epoch or more apart).

Three recipes: ``imagenet-train`` (examples/pipelines/imagenet-train.toml: decode → random_resized_crop 224 →
flip → normalize, float32 out); ``uint8`` (the same without normalize: uint8 out, normalized on the
trainer's GPU, as DALI and FFCV pipelines do); ``fixed`` (AlexNet's: decode → resize 256 → center_crop 256,
all cached, then random_crop 224 → flip, uint8 out). The random stages after the cache run per job and
per sample, so they stay in every job's bill: a RandomResizedCrop resamples the decoded image, about a
third of a decode; a crop of a fixed-size array is a copy. Each job's batches are hashed: the cached rows must give each
job the bytes of the uncached rows (``identical``).

    .venv/bin/python -m benchmarks.decode_cache [--images 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import threading
import time
from pathlib import Path

from libbus.connect.client import Client, Identity
from libbus.loader.remote import RemoteLoader
from libbus.security.auth import ensure_secret, issue_token
from libbus.wire.messages import Stats
from services.launch import ServiceProcs

from .images import EXAMPLE, make_images

__all__ = ["main"]

JOBS = 4


FIXED = """
[[stages]]
name = "files"
source = {{ uri = "file://{root}?encoded=1&val_fraction=0" }}
[[stages]]
name = "decode"
input = "files"
decode = {{}}
[[stages]]
name = "resize"
input = "decode"
resize = {{ size = 256 }}
[[stages]]
name = "square"
input = "resize"
center_crop = {{ size = 256 }}
[[stages]]
name = "crop"
input = "square"
random_crop = {{ size = 224 }}
[[stages]]
name = "flip"
input = "crop"
flip = {{}}
"""


def recipe(root: Path, name: str) -> str:
    if name == "fixed":
        return FIXED.format(root=root)
    text = EXAMPLE.read_text().replace("file:///data/imagenet", f"file://{root}")
    text = text.replace("?encoded=1", "?encoded=1&val_fraction=0")
    if name == "uint8":
        text = text[: text.index('[[stages]]\nname = "normalize"')]
    return text


def provider_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


#: Rows: (name, the jobs' (seed, epoch), cache on); the last three for imagenet-train only.
ROWS = [
    ("one", [(0, 0)], False),
    ("one_cached", [(0, 0)], True),
    ("four", [(s, 0) for s in range(JOBS)], False),
    ("four_cached", [(s, 0) for s in range(JOBS)], True),
    ("four_same_seed_cached", [(0, 0)] * JOBS, True),
    ("four_epochs", [(s, s) for s in range(JOBS)], False),
    ("four_epochs_cached", [(s, s) for s in range(JOBS)], True),
]


def run(state: Path, pipeline: Path, jobs: list[tuple[int, int]], cache_bytes: int) -> dict:
    """One fresh router and provider; a loader per ``(seed, epoch)`` of ``jobs`` reads that epoch, all at once."""
    secret = ensure_secret(state / "secret")
    token = issue_token(secret, sub="bench", role="trainer", audience="batchbus", ttl_s=3600, datasets=["img"])
    procs = ServiceProcs(state)
    try:
        router = procs.start("router", "--bind", "tcp://127.0.0.1:0", "--log-level", "WARNING")
        os.environ["BATCHBUS_DECODE_CACHE_BYTES"] = str(cache_bytes)  # the provider's setting, by environment
        try:
            endpoint = procs.start(
                "provider", "--router", router, "--log-level", "WARNING", "--dataset", f"img=pipeline://{pipeline}"
            )
        finally:
            del os.environ["BATCHBUS_DECODE_CACHE_BYTES"]
        pid = procs.procs["provider"].pid
        digests: list[tuple[tuple[int, int], str]] = []
        samples = [0] * len(jobs)
        errors: list[BaseException] = []
        gate = threading.Barrier(len(jobs) + 1)

        def job(number: int, seed: int, epoch: int) -> None:
            try:
                digest = hashlib.sha256()
                with RemoteLoader(
                    "img", provider=endpoint, token=token, batch_size=32, seed=seed, drop_last=True
                ) as loader:
                    loader.set_epoch(epoch)
                    gate.wait()
                    for x, y in loader:
                        digest.update(x.numpy().tobytes())
                        digest.update(y.numpy().tobytes())
                        samples[number] += len(x)
                digests.append(((seed, epoch), digest.hexdigest()))
            except BaseException as err:  # noqa: BLE001 - reported by the main thread
                errors.append(err)
                gate.abort()

        threads = [threading.Thread(target=job, args=(i, *pair)) for i, pair in enumerate(jobs)]
        for t in threads:
            t.start()
        gate.wait()  # every loader connected: count the provider's CPU from here
        cpu0, started = provider_cpu(pid), time.perf_counter()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        cpu, wall = provider_cpu(pid) - cpu0, time.perf_counter() - started
        return {
            "cpu_s": round(cpu, 3),
            "wall_s": round(wall, 2),
            "samples": sum(samples),
            "decoded": decoded(router, secret),
            "final_hits": final_hits(router, secret),
            "digests": digests,
        }
    finally:
        procs.stop()


def final_hits(router: str, secret: bytes) -> int:
    """Samples the provider served whole from its cache (final outputs), from its stats on the router."""
    token = issue_token(secret, sub="bench-admin", role="admin", audience="batchbus", ttl_s=600)
    with Client(router, Identity(role="admin", name="bench-admin", token=token), timeout_s=10) as client:
        rows = [r for r in client.request(Stats()).services.values() if r.get("role") == "provider"]
    cache = rows[0].get("decode_cache") if rows else None
    return int(cache.get("final", {}).get("hits", 0)) if isinstance(cache, dict) else 0


def identical(rows: dict) -> bool:
    """Every cached row's job got the bytes the uncached rows got for its (seed, epoch), and each such
    (seed, epoch) was read uncached."""
    plain: dict[tuple[int, int], set[str]] = {}
    for name, row in rows.items():
        if not name.endswith("cached"):
            for pair, digest in row["digests"]:
                plain.setdefault(pair, set()).add(digest)
    if any(len(d) != 1 for d in plain.values()):
        return False
    cached = [item for name, row in rows.items() if name.endswith("cached") for item in row["digests"]]
    return all(pair in plain and plain[pair] == {digest} for pair, digest in cached)


def decoded(router: str, secret: bytes) -> int:
    """Images the provider's ``decode`` stage decoded, from its stats on the router (a heartbeat late)."""
    token = issue_token(secret, sub="bench-admin", role="admin", audience="batchbus", ttl_s=600)
    with Client(router, Identity(role="admin", name="bench-admin", token=token), timeout_s=10) as client:
        last, deadline = -1, time.monotonic() + 10
        while time.monotonic() < deadline:
            rows = [r for r in client.request(Stats()).services.values() if r.get("role") == "provider"]
            stages = rows[0]["pipelines"]["img"]["stages"] if rows and "pipelines" in rows[0] else []
            now = next((s["items_in"] for s in stages if s["name"] == "decode"), -1)
            if now == last and now >= 0:
                return now
            last = now
            time.sleep(1.5)  # the default heartbeat is 1 s: two equal readings span one
    return last


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--recipes", default="imagenet-train,uint8,fixed", help="comma-separated, in this order")
    args = parser.parse_args(argv)
    # decoded 500×375 RGB images as Pillow holds them (4 bytes a pixel), with room for one epoch's final
    # outputs (imagenet-train's float32 3×224×224: 602 KB a sample)
    cache_bytes = args.images * 500 * 375 * 4 * 2
    out: dict = {"images": args.images, "jobs": JOBS, "cores": len(os.sched_getaffinity(0)), "recipes": {}}
    with tempfile.TemporaryDirectory(prefix="batchbus-decode-cache-") as tmp:
        root = Path(tmp) / "data"
        make_images(root, args.images)
        for name in args.recipes.split(","):
            pipeline = Path(tmp) / f"{name}.toml"
            pipeline.write_text(recipe(root, name))
            rows = {}
            for row, jobs, cache in ROWS[: len(ROWS) if name == "imagenet-train" else 4]:
                rows[row] = run(Path(tmp) / f"{name}-{row}", pipeline, jobs, cache_bytes if cache else 0)
            one = rows["one"]["cpu_s"]
            out["recipes"][name] = {
                **{row: {k: v for k, v in r.items() if k != "digests"} for row, r in rows.items()},
                **{f"{row}_vs_one": round(r["cpu_s"] / one, 2) for row, r in rows.items() if row != "one"},
                "identical": identical(rows),
            }
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
