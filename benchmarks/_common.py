"""Shared benchmark plumbing: run a worker under `popmesh launch`, collect rank 0's JSON, time things."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent


def resident_bytes() -> int:
    """This process's resident set (VmRSS), in bytes: what the memory benchmarks compare."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def launch_json(script: str, n: int, engine: str, *args: str, timeout: float = 600,
                options: Sequence[str] = ()) -> dict:
    """Run ``script`` on ``n`` ranks of ``engine`` (``options``: more of ``popmesh launch``'s, such as
    ``--max-restarts 1``); rank 0 writes JSON to $BENCH_OUT, returned here."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = dict(os.environ, BENCH_OUT=str(out))
        cmd = [sys.executable, "-m", "popmesh", "launch", "-n", str(n), "--engine", engine,
               "--quiet-others", *options, str(HERE / script), *args]
        subprocess.run(cmd, env=env, check=True, timeout=timeout)
        return json.loads(out.read_text())


def free_port() -> int:
    """A loopback port that was free a moment ago (a benchmark's rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_result(result: dict) -> None:
    """Called by rank 0 of a worker."""
    path = os.environ.get("BENCH_OUT")
    if path:
        Path(path).write_text(json.dumps(result))


def median_time(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median seconds of ``fn`` over ``reps`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def interleaved(fns: dict[str, Callable[[], object]], reps: int, rounds: int = 5) -> dict[str, float]:
    """Median over ``rounds`` of per-round medians. The contenders alternate, in reverse order every
    other round, so drift within a round and whatever one contender leaves behind for the next (cold
    caches after a large transfer) fall on all of them alike."""
    per: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    for r in range(rounds):
        for name, fn in order if r % 2 == 0 else order[::-1]:
            per[name].append(median_time(fn, reps))
    return {name: statistics.median(values) for name, values in per.items()}


def reps(n: int) -> int:
    """``n`` scaled by $BENCH_REPS_SCALE (default 1, at least 1 rep): shorter runs at more ranks."""
    return max(1, round(n * float(os.environ.get("BENCH_REPS_SCALE", "1"))))


def thread_counts() -> tuple[int, int]:
    """This process's threads now: Python's (``threading.active_count()``) and the OS's (the
    ``Threads:`` line of /proc/self/status: engine and BLAS threads too; 0 where there is no /proc)."""
    try:
        status = Path("/proc/self/status").read_text()
        os_threads = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Threads:"))
    except (OSError, StopIteration):
        os_threads = 0
    return threading.active_count(), os_threads


def world_threads() -> dict[str, int]:
    """Every rank must call this: the most threads on any rank, Python's and the OS's."""
    import numpy as np

    import popmesh

    most = popmesh.all_reduce(np.array(thread_counts(), dtype=np.int64), "max")
    return {"python": int(most[0]), "os": int(most[1])}


def threads_line(result: dict) -> str:
    t = result.get("threads")
    return f"threads per rank (max over ranks): {t['python']} Python, {t['os']} OS" if t else ""


def on_python_path(p2p, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with the MPI transport's C path switched off while it runs (``p2p._native``), as where it is
    not built or ``POPMESH_MPI_NATIVE=0``: the Python path, timed in the same processes."""
    native = p2p._native

    def run() -> object:
        p2p._native = None
        try:
            return fn()
        finally:
            p2p._native = native

    return run
