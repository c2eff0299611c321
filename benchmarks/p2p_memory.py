"""Memory per rank of the point-to-point layer in a wide world on one box (docs/messages.md).

Each rank records its resident set (VmRSS) after importing the engine (the baseline: what the
engine costs before popmesh does anything), after ``popmesh.init`` and a collective, and after
messages with every peer (a 64 KiB frame to and from each, on a tag per peer, then 1 MiB around
a ring), with the transport's own tables (``p2p.memory()``) and its threads. Prints, per world
size, the median and largest RSS growth over the baseline and the ratio to the baseline.

    python benchmarks/p2p_memory.py [--ranks 2,8,16,32] [--engines torch,mpi]
    (worker: python -m popmesh launch -n N --engine E benchmarks/p2p_memory.py --worker)
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading

from _common import launch_json, resident_bytes, write_result


def worker() -> None:
    import numpy as np

    if "PMI_RANK" in os.environ:  # under mpiexec (hydra)
        import mpi4py.MPI  # noqa: F401  the engine's own import, before popmesh starts it
    else:
        import torch.distributed  # noqa: F401
    base = resident_bytes()
    import popmesh
    from popmesh.comm import messages as m

    world = popmesh.init()
    rank, size = world.rank, world.size
    popmesh.all_reduce(np.ones(4), timeout=600)
    after_init = resident_bytes()
    peers = [p for p in range(size) if p != rank]
    sends = [m.isend(np.full(1 << 13, rank, np.int64), p, tag=100 + rank) for p in peers]
    for p in peers:
        src, got = m.recv(p, tag=100 + p, timeout=600)
        assert src == p and int(got[0]) == p
    for h in sends:
        h.wait(600)
    right, left = (rank + 1) % size, (rank - 1) % size
    h = m.isend(np.full(1 << 17, rank, np.int64), right, tag=7)
    assert int(m.recv(left, tag=7, timeout=600)[1][0]) == left
    h.wait(600)
    popmesh.barrier(timeout=600)
    after = resident_bytes()
    mem = world.engine.p2p().memory()
    threads = len([t for t in threading.enumerate() if t.name.startswith("popmesh-")])
    rows = popmesh.all_gather(np.array([base, after_init, after, threads, mem.get("send_channels", 0),
                                        mem.get("posted_tags", 0)], dtype=np.float64), timeout=600)
    if rank == 0:
        write_result({"rows": rows.tolist()})
    world.finalize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,8,16,32")
    parser.add_argument("--engines", default="torch,mpi")
    parser.add_argument("--worker", action="store_true")
    opts = parser.parse_args()
    if opts.worker:
        worker()
        return
    print(f"{'engine':6} {'ranks':>5} {'baseline RSS':>13} {'after init':>11} {'after msgs':>11} "
          f"{'max growth':>11} {'vs baseline':>11} {'threads':>8} {'send tables':>12}")
    for engine in opts.engines.split(","):
        for n in [int(x) for x in opts.ranks.split(",")]:
            rows = launch_json(os.path.abspath(__file__), n, engine, "--worker", timeout=900)["rows"]
            mib = 1 << 20
            base = statistics.median(r[0] for r in rows)
            init = statistics.median(r[1] - r[0] for r in rows)
            grown = [r[2] - r[0] for r in rows]
            print(f"{engine:6} {n:5} {base / mib:10.0f} MiB {init / mib:+8.1f} MiB "
                  f"{statistics.median(grown) / mib:+8.1f} MiB {max(grown) / mib:+8.1f} MiB "
                  f"{statistics.median(r[2] / r[0] for r in rows):10.2f}x {int(max(r[3] for r in rows)):8} "
                  f"{int(max(r[4] for r in rows)):12}")
    print("(RSS per rank, median over ranks unless 'max'; growth: over the baseline measured in the same "
          "process after importing the engine; one box, so wide worlds measure oversubscription too)")


if __name__ == "__main__":
    main()
