"""Stream a dataset several times larger than a memory limit and show the limit holds.

Generates a raw ``file://`` dataset (``--size-mb``, at least 4× ``--limit-mb``), drops it from the
page cache, then runs a provider-like reader process that opens it with ``memory=stream`` and reads
random batches through ``Source.read_into`` into one reused batch buffer, as fast as it can, for
``--seconds``. The reader runs inside a memory cgroup capped at ``--limit-mb`` (cgroup v2, else v1;
page cache is charged there too and reclaimed at the cap); where no cgroup can be made it checks a
resident-memory ceiling from its own ``VmHWM`` instead. Reports peak reader RSS, throughput and
whether the limit held::

    python -m benchmarks.stream_memory --size-mb 1024 --limit-mb 256 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["main", "make_dataset", "memory_cgroup"]

MB = 1 << 20
SAMPLE_BYTES = 3072  # a CIFAR-sized sample; uint8 labels beside it


def make_dataset(root: Path, size_mb: int) -> int:
    """Write ``size_mb`` of raw samples (+ labels) under ``root``, evicted from the page cache.
    Returns the number of samples."""
    n = size_mb * MB // SAMPLE_BYTES
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, 16 * MB, dtype=np.uint8)
    with open(root / "x.u8", "wb") as f:
        left = n * SAMPLE_BYTES
        while left:
            chunk = block[: min(left, len(block))]
            f.write(chunk.tobytes())
            left -= len(chunk)
            block = np.roll(block, 4099)  # not one block repeated: no dedup or compression helps
        f.flush()
        os.fsync(f.fileno())
        # start cold: the reader's reads hit the disk and are charged to its cgroup
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    (rng.integers(0, 10, n, dtype=np.uint8)).tofile(root / "y.u8")
    (root / "dataset.toml").write_text(
        f'[train]\nx = "x.u8"\ndtype = "uint8"\nshape = [{SAMPLE_BYTES}]\ny = "y.u8"\nlabel_dtype = "uint8"\n'
    )
    return n


class memory_cgroup:
    """A memory cgroup capped at ``limit`` bytes, removed on exit; ``path`` is None where none can be
    made (no memory controller, not writable)."""

    def __init__(self, limit: int, name: str):
        self.limit, self.name, self.path, self.version = limit, name, None, None

    def __enter__(self) -> memory_cgroup:  # noqa: PYI034
        for version, base in self._candidates():
            path = base / self.name
            try:
                path.mkdir()
            except OSError:
                continue
            try:
                if version == 2:
                    (path / "memory.max").write_text(str(self.limit))
                    if (path / "memory.swap.max").exists():
                        (path / "memory.swap.max").write_text("0")
                else:
                    (path / "memory.limit_in_bytes").write_text(str(self.limit))
                    if (path / "memory.memsw.limit_in_bytes").exists():
                        (path / "memory.memsw.limit_in_bytes").write_text(str(self.limit))
            except OSError:
                path.rmdir()
                continue
            self.path, self.version = path, version
            break
        return self

    @staticmethod
    def _candidates():
        mounts = [line.split()[:4] for line in Path("/proc/mounts").read_text().splitlines()]
        own = {}  # hierarchy → this process's cgroup in it: nest there (containers see only theirs)
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, rel = line.split(":", 2)
            own[controllers or "v2"] = rel.lstrip("/")
        for _, mount, fstype, _opts in mounts:
            if fstype == "cgroup2":
                base = Path(mount) / own.get("v2", "")
                if "memory" in (Path(mount) / "cgroup.controllers").read_text().split():
                    yield 2, base
        for _, mount, fstype, opts in mounts:
            if fstype == "cgroup" and "memory" in opts.split(","):
                yield 1, Path(mount) / own.get("memory", "")

    def join(self) -> None:
        """Move the calling process in (run in the child before exec)."""
        if self.path is not None:
            (self.path / "cgroup.procs").write_text("0" if self.version == 2 else str(os.getpid()))

    def stats(self) -> dict:
        """The cgroup's own peak (page cache included) and OOM kills."""
        if self.path is None:
            return {}

        def read(name: str) -> str:
            return (self.path / name).read_text() if (self.path / name).exists() else ""

        if self.version == 2:
            events = dict(line.split() for line in read("memory.events").splitlines())
            peak = read("memory.peak").strip()
            return {"cgroup_peak_mb": int(peak) / MB if peak else None, "oom_kills": int(events.get("oom_kill", 0))}
        oom = dict(line.split() for line in read("memory.oom_control").splitlines())
        return {"cgroup_peak_mb": int(read("memory.max_usage_in_bytes")) / MB, "oom_kills": int(oom.get("oom_kill", 0))}

    def __exit__(self, *exc) -> None:
        if self.path is not None:
            for _ in range(50):  # the reader has exited; its cgroup empties a moment later
                try:
                    self.path.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


def reader(uri: str, seconds: float, batch: int, order: str) -> dict:
    """The provider-like loop: random batches through ``read_into`` into one reused buffer."""
    from services.provider.sources import open_source  # only the reader process needs it
    from services.provider.sources.formats.dataset import FileSource

    source = open_source(uri)
    n = source.num_samples("train")
    x = np.empty((batch, *source.sample_shape), source.dtype)
    y = np.empty((batch, *source.label_shape), source.label_dtype)
    rng = np.random.default_rng(1)
    samples, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds and samples < n:
        if order == "full":
            idx = rng.integers(0, n, batch)
        else:  # block: a random contiguous block, shuffled inside; coalesced into one read
            start = int(rng.integers(0, n - batch))
            idx = rng.permutation(np.arange(start, start + batch))
        source.read_into("train", idx, x, y)
        samples += batch
    elapsed = time.perf_counter() - started
    status = Path("/proc/self/status").read_text()
    hwm = int(status.split("VmHWM:")[1].split()[0]) * 1024
    return {
        "memory": source.memory if isinstance(source, FileSource) else None,
        "samples": samples,
        "seconds": elapsed,
        "vmhwm": hwm,
        "sample_bytes": source.sample_nbytes,
    }


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print a table and return the results as a dict."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.stream_memory", description=__doc__.split("\n")[0])
    p.add_argument("--size-mb", type=int, default=0, help="dataset size (default 4x --limit-mb)")
    p.add_argument("--limit-mb", type=int, default=256, help="memory limit for the reader process")
    p.add_argument("--seconds", type=float, default=10.0, help="how long the reader reads")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument(
        "--order",
        choices=("full", "block"),
        default="full",
        help="full: random indices; block: shuffled contiguous blocks",
    )
    p.add_argument("--dir", type=Path, default=None, help="where to write the dataset (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        result = reader(args.worker, args.seconds, args.batch, args.order)
        print(json.dumps(result))
        return result
    size_mb = args.size_mb or 4 * args.limit_mb
    if size_mb < 4 * args.limit_mb:
        p.error(f"--size-mb {size_mb} must be at least 4x --limit-mb ({4 * args.limit_mb})")
    root = Path(tempfile.mkdtemp(prefix="batchbus-bench-", dir=args.dir))
    try:
        started = time.perf_counter()
        n = make_dataset(root, size_mb)
        generated = time.perf_counter() - started
        limit = args.limit_mb * MB
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.stream_memory",
            "--worker",
            f"file://{root}?memory=stream",
            "--seconds",
            str(args.seconds),
            "--batch",
            str(args.batch),
            "--order",
            args.order,
        ]
        cwd = Path(__file__).resolve().parent.parent
        with memory_cgroup(limit, f"batchbus-bench-{os.getpid()}") as cg:
            proc = subprocess.run(
                cmd,
                check=False,
                cwd=cwd,
                capture_output=True,
                text=True,
                preexec_fn=cg.join,
                timeout=args.seconds + 300,
            )
            cg_stats = cg.stats()
            enforcement = f"cgroup v{cg.version} ({cg.path})" if cg.path else "VmHWM ceiling (no cgroup)"
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if proc.returncode:
        result = {
            "ok": False,
            "returncode": proc.returncode,
            "stderr": proc.stderr[-2000:],
            "enforcement": enforcement,
            **cg_stats,
        }
    else:
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        mb_s = r["samples"] * r["sample_bytes"] / MB / r["seconds"]
        result = {
            "ok": True,
            "dataset_mb": size_mb,
            "samples_in_dataset": n,
            "limit_mb": args.limit_mb,
            "enforcement": enforcement,
            "order": args.order,
            "batch": args.batch,
            "peak_rss_mb": round(r["vmhwm"] / MB, 1),
            "samples_read": r["samples"],
            "seconds": round(r["seconds"], 2),
            "samples_per_s": round(r["samples"] / r["seconds"]),
            "mb_per_s": round(mb_s, 1),
            "generate_s": round(generated, 1),
            **cg_stats,
        }
    result["limit_held"] = bool(result["ok"] and result["peak_rss_mb"] * MB <= limit and not result.get("oom_kills"))
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(0 if main().get("limit_held", True) else 1)
