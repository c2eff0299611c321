"""Claim: `popmesh launch` brings up a 4-rank gloo world no slower than torchrun (ratio <= 1.0x), and with
`--preload torch` several times faster wherever ranks outnumber cores.

Each variant starts 4 CPU ranks of tests/world/scripts/launch_torch_worker.py, which prints
``READY <time.time()>`` after init_process_group and one barrier. Measured per run:

* ready: wall time from starting the launcher until the last rank is ready,
* total: wall time until the launcher (and every rank) has exited.

Variants, interleaved within each repetition so machine load hits them alike:

* popmesh: ``python -m popmesh launch -n 4`` (rank 0 serves the TCPStore on the launcher's socket),
* preload: the same with ``--preload torch`` (ranks forked from a fork server that imported torch once),
* torchrun: ``python -m torch.distributed.run --standalone --nproc-per-node 4``,
* naive: 4 ``subprocess.Popen`` ranks with env:// (rank 0 binds the store itself, no launcher).

Usage: ``python benchmarks/launch.py [--reps 5] [--nproc 4]``; ``--nproc 4,16,32`` measures each size in turn
(wide worlds: beyond 8 peers popmesh's gloo transport receives on one thread).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

WORKER = str(Path(__file__).resolve().parents[1] / "tests" / "world" / "scripts" / "launch_torch_worker.py")
READY = re.compile(r"READY (\d+\.\d+)")
TIMEOUT_S = 120


def _clean_env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "POPMESH_ENGINE")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _measure(start: Callable[[], list[subprocess.Popen[str]]], nproc: int) -> tuple[float, float]:
    """Start processes, return (seconds until the last READY line, seconds until all exited)."""
    t0 = time.time()
    procs = start()
    outputs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    total = time.time() - t0
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a run failed: exit codes {[p.returncode for p in procs]}\n{''.join(outputs)[-2000:]}")
    ready = [float(m) for out in outputs for m in READY.findall(out)]
    if len(ready) != nproc:
        raise RuntimeError(f"expected {nproc} READY lines, got {len(ready)}")
    return max(ready) - t0, total


def _popmesh(nproc: int) -> list[subprocess.Popen[str]]:
    cmd = [sys.executable, "-m", "popmesh", "launch", "-n", str(nproc), WORKER, "bench"]
    return [subprocess.Popen(cmd, env=_clean_env(), stdout=subprocess.PIPE, text=True)]


def _preload(nproc: int) -> list[subprocess.Popen[str]]:
    cmd = [sys.executable, "-m", "popmesh", "launch", "-n", str(nproc), "--preload", "torch", WORKER, "bench"]
    return [subprocess.Popen(cmd, env=_clean_env(), stdout=subprocess.PIPE, text=True)]


def _torchrun(nproc: int) -> list[subprocess.Popen[str]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", WORKER, "bench"]
    env = {**_clean_env(), "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    return [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)]


def _naive(nproc: int) -> list[subprocess.Popen[str]]:
    with socket.socket() as probe:  # the free-port race the launcher's pre-bound socket avoids
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = {**_clean_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc)}
    base["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    return [
        subprocess.Popen([sys.executable, WORKER, "bench"], env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                         stdout=subprocess.PIPE, text=True)
        for r in range(nproc)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--nproc", default="4", help="ranks, or a comma-separated list of sizes")
    opts = parser.parse_args()
    for nproc in (int(n) for n in str(opts.nproc).split(",")):
        _compare(nproc, opts.reps)


def _compare(nproc: int, reps: int) -> None:
    variants = {"popmesh": _popmesh, "preload": _preload, "torchrun": _torchrun, "naive": _naive}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for rep in range(reps):
        for name, start in variants.items():
            results[name].append(_measure(lambda s=start: s(nproc), nproc))
        print(f"rep {rep + 1}/{reps}: " + ", ".join(f"{n} ready {r[-1][0]:.2f}s" for n, r in results.items()))
    print(f"\n{nproc}-rank gloo world, {reps} reps, {os.cpu_count()} cpus; medians:")
    print(f"{'variant':<10}{'ready (s)':>12}{'total (s)':>12}")
    med = {n: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)) for n, rs in results.items()}
    for name, (ready, total) in med.items():
        print(f"{name:<10}{ready:>12.3f}{total:>12.3f}")
    for ours, other in (("popmesh", "torchrun"), ("popmesh", "naive"), ("preload", "torchrun"), ("preload", "popmesh")):
        print(
            f"{ours} / {other}: ready {med[ours][0] / med[other][0]:.2f}x, "
            f"total {med[ours][1] / med[other][1]:.2f}x"
        )
    print()


if __name__ == "__main__":
    main()
