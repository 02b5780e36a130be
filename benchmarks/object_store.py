"""Read random token batches from ``s3://`` on a loopback S3 server (moto) with added latency, without
a cache, with a cold disk cache and a warm one; and compare object-store client libraries' range reads.

Uploads 4 token shards of 4 MiB to the test suite's S3 server (``tests/support/s3server.py``, so run it
from a checkout; moto in server mode, behind a proxy adding ``--delay-ms`` to every request as a stand-in
for network latency), then reads 20 random batches of 64 samples of 2 KiB each way, every batch checked
against ``file://``. Reports samples/s and requests per batch. ``--clients`` also times 200 random
2 KiB range reads, one at a time, through obstore, boto3 and s3fs (those installed)::

    python -m benchmarks.object_store --delay-ms 20 --clients
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, cast

import numpy as np

__all__ = ["main"]

SEQ_LEN = 1023  # 1024 two-byte tokens: 2 KiB a sample
BATCH, BATCHES = 64, 20
SHARD_TOKENS = 2 << 20  # 4 MiB a shard

SERVER = (
    "import sys, time; from pathlib import Path; from tests.support.s3server import S3Server; "
    "s = S3Server(); s.delay_s = float(sys.argv[2]) / 1000; s.put_dir('bench', 'tok', Path(sys.argv[1])); "
    "print(s.url, s.access_key, s.secret_key, flush=True); time.sleep(3600)"
)


def _batches(source, local, rng) -> tuple[float, float]:
    """samples/s and requests per batch over :data:`BATCHES` random batches, each checked against ``local``."""
    from services.provider.sources.storage.objects import STATS

    n = source.num_samples("train")
    batches = [rng.integers(0, n, BATCH) for _ in range(BATCHES)]
    before = STATS["requests"]
    t = time.perf_counter()
    for idx in batches:
        x, _ = source.read("train", idx)
        if not np.array_equal(x, local.read("train", idx)[0]):
            raise SystemExit("a batch read from s3:// differs from the file's bytes")
    elapsed = time.perf_counter() - t
    return BATCH * BATCHES / elapsed, (STATS["requests"] - before) / BATCHES


def _clients(url: str, key: str, secret: str, rng) -> list[tuple[str, float]]:
    """Mean seconds per random 2 KiB range read, one at a time, for each client library installed."""
    offsets = rng.integers(0, SHARD_TOKENS * 2 - 2048, 200).tolist()
    out = []
    import obstore
    from obstore.store import from_url

    store = from_url("s3://bench", client_options={"allow_http": True}, retry_config={"max_retries": 0})
    buf = bytearray(2048)

    def ob(o):
        memoryview(buf)[:] = memoryview(obstore.get_range(store, "tok/s-0.bin", start=o, length=2048))

    out.append(("obstore", ob))
    try:
        import boto3

        client = boto3.client("s3", endpoint_url=url)

        def b3(o):
            body = client.get_object(Bucket="bench", Key="tok/s-0.bin", Range=f"bytes={o}-{o + 2047}")["Body"]
            memoryview(buf)[:] = body.read()

        out.append(("boto3", b3))
    except ImportError:
        pass
    try:
        import s3fs

        fs = s3fs.S3FileSystem(endpoint_url=url, key=key, secret=secret)

        def sf(o):
            memoryview(buf)[:] = fs.cat_file("bench/tok/s-0.bin", start=o, end=o + 2048)

        out.append(("s3fs", sf))
    except ImportError:
        pass
    timings = []
    for name, read in out:
        read(offsets[0])  # connect, sign once
        t = time.perf_counter()
        for o in offsets:
            read(o)
        timings.append((name, (time.perf_counter() - t) / len(offsets)))
    return timings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delay-ms", type=float, default=20.0, help="added to every request by the proxy")
    ap.add_argument("--clients", action="store_true", help="also compare client libraries' range reads")
    args = ap.parse_args(argv)
    from services.provider.sources import open_source  # after argument checks

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "tok").mkdir()
        rng = np.random.default_rng(0)
        for i in range(4):
            (root / "tok" / f"s-{i}.bin").write_bytes(rng.integers(0, 50000, SHARD_TOKENS, dtype=np.uint16).tobytes())
        server = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(root / "tok"), str(args.delay_ms)], stdout=subprocess.PIPE, text=True
        )
        try:
            url, key, secret = cast(IO[str], server.stdout).readline().split()  # stdout=PIPE
            os.environ.update(
                AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret, AWS_ENDPOINT_URL=url, AWS_REGION="us-east-1"
            )
            local = open_source(f"file://{root / 'tok'}?seq_len={SEQ_LEN}&token_bytes=2&memory=stream")
            base = f"s3://bench/tok/?seq_len={SEQ_LEN}&token_bytes=2"
            cache = root / "cache"
            rows = []
            for label, query in (
                ("no cache", "&cache=off"),
                ("cache, cold", f"&cache_dir={cache}&cache_limit={64 << 20}&block=65536"),
                ("cache, warm", f"&cache_dir={cache}&cache_limit={64 << 20}&block=65536"),
            ):
                src = open_source(base + query)
                n = src.num_samples("train")
                rng = np.random.default_rng(1)  # the same batches each time: warm re-reads what cold read
                if label == "cache, warm":
                    src.read("train", np.arange(n))  # everything in the cache: warm means warm
                rows.append((label, *_batches(src, local, rng)))
                src.close()
            print(f"{args.delay_ms:g} ms added latency, {BATCHES} random batches of {BATCH} x 2 KiB")
            print("| reads | samples/s | requests per batch |")
            print("|---|---:|---:|")
            for label, rate, reqs in rows:
                print(f"| {label} | {rate:,.0f} | {reqs:.1f} |")
            if args.clients:
                print("\n| client | ms per 2 KiB range read |")
                print("|---|---:|")
                for name, seconds in _clients(url, key, secret, np.random.default_rng(2)):
                    print(f"| {name} | {seconds * 1000:.1f} |")
        finally:
            server.terminate()
            server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
