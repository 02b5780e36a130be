"""Read token batches over ``http://`` from a local range server and compare concurrency settings.

Writes 4 token shards of 16 MiB, serves them with the test suite's range server
(``tests/support/httpd.py``, so run it from a checkout) in another process with ``--delay-ms`` added to
every request (a stand-in for network latency), and reads 20 batches of 64 samples of 2 KiB, random
and sequential, with ``concurrency`` 1 and 8. Checks every batch against ``file://``::

    python -m benchmarks.http_reads --delay-ms 20
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delay-ms", type=float, default=0.0, help="added to every request by the server")
    args = ap.parse_args(argv)
    from services.provider.sources import open_source  # after argument checks

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "tok").mkdir()
        rng = np.random.default_rng(0)
        for i in range(4):
            tokens = rng.integers(0, 50000, 8 << 20, dtype=np.uint16)
            (root / "tok" / f"s-{i}.bin").write_bytes(tokens.tobytes())
        code = (
            "import sys, time; from pathlib import Path; from tests.support.httpd import RangeServer; "
            "s = RangeServer(Path(sys.argv[1])); s.delay_s = float(sys.argv[2]) / 1000; "
            "print(s.url, flush=True); time.sleep(3600)"
        )
        server = subprocess.Popen(
            [sys.executable, "-c", code, str(root), str(args.delay_ms)], stdout=subprocess.PIPE, text=True
        )
        try:
            url = cast(IO[str], server.stdout).readline().strip()  # stdout=PIPE
            local = open_source(f"file://{root / 'tok'}?seq_len={SEQ_LEN}&token_bytes=2&memory=stream")
            for concurrency in (1, 8):
                src = open_source(f"{url}/tok/s-{{0..3}}.bin?seq_len={SEQ_LEN}&token_bytes=2&concurrency={concurrency}")
                n = src.num_samples("train")
                for order in ("random", "sequential"):
                    starts = rng.integers(0, n - BATCH, BATCHES)
                    batches = [
                        rng.integers(0, n, BATCH) if order == "random" else np.arange(a, a + BATCH) for a in starts
                    ]
                    t = time.perf_counter()
                    got = [src.read("train", b)[0] for b in batches]
                    dt = time.perf_counter() - t
                    if not all(np.array_equal(x, local.read("train", b)[0]) for x, b in zip(got, batches)):
                        raise SystemExit("http and file reads differ")
                    rate = BATCHES * BATCH / dt
                    print(
                        f"concurrency={concurrency} {order:10s}: {rate:8.0f} samples/s, "
                        f"{rate * 2 * (SEQ_LEN + 1) / 2**20:6.1f} MiB/s, "
                        f"{'one request per sample' if order == 'random' else 'one request per batch'}"
                    )
        finally:
            server.kill()
            server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
