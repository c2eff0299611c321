"""Memory of messages sent but not received yet, on 2 ranks (docs/scaling.md, docs/messages.md).

Rank 0 starts ``--count`` sends of ``--nbytes``-byte payloads to rank 1 on one tag (``isend``, handles
kept) and polls the last one, while rank 1 receives nothing on that tag for ``--stall`` seconds but
polls a receive on another (a rank busy with other traffic): MPI progresses on both all along.
Rank 1 then records how much its resident set (VmRSS) grew, receives every message and checks each
arrived intact and in order. Prints, per payload size, both ranks' RSS growth, and what rank 0's
transport held meanwhile (``p2p.memory()``).

    python benchmarks/p2p_unreceived.py [--engine mpi] [--nbytes 4,1024] [--count 100000] [--stall 10]
    (worker: python -m popmesh launch -n 2 --engine E benchmarks/p2p_unreceived.py --worker ...)
"""

from __future__ import annotations

import argparse
import os
import time

from _common import launch_json, resident_bytes, write_result


def worker(nbytes: int, count: int, stall: float) -> None:
    import numpy as np

    import popmesh
    from popmesh.comm import messages as m

    world = popmesh.init()
    payload = np.zeros(max(1, nbytes // 4), np.int32)
    popmesh.barrier(timeout=600)
    base = resident_bytes()
    held: dict = {}
    if world.rank == 0:
        started = time.monotonic()
        handles = []
        for i in range(count):
            payload[0] = i
            handles.append(m.isend(payload.copy() if nbytes >= 1 << 16 else payload, 1, tag=3))
        posted_s = time.monotonic() - started
        while time.monotonic() - started < stall:  # MPI progresses here too: what it can push, it does
            handles[-1].done()
            time.sleep(0.001)
        held = world.engine.p2p().memory()
    else:  # busy elsewhere: polls a receive on another tag, so MPI progresses here all along
        other, until = m.irecv(0, tag=4), time.monotonic() + stall
        while time.monotonic() < until:
            other.done()
            time.sleep(0.001)
        del other
    grown = resident_bytes() - base
    popmesh.barrier(timeout=600)
    if world.rank == 1:
        for i in range(count):
            src, got = m.recv(0, tag=3, timeout=600)
            assert src == 0 and int(got[0]) == i and got.size == payload.size, (i, got[:2])
    else:
        for h in handles:
            h.wait(600)
    rows = popmesh.all_gather(np.array([grown], dtype=np.float64), timeout=600)
    if world.rank == 0:
        write_result({"grown": rows[:, 0].tolist(), "held": {k: int(v) for k, v in held.items()},
                      "posted_s": posted_s})
    world.finalize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="mpi")
    parser.add_argument("--nbytes", default="4,1024")
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--stall", type=float, default=10.0)
    parser.add_argument("--worker", action="store_true")
    opts = parser.parse_args()
    if opts.worker:
        worker(int(opts.nbytes), opts.count, opts.stall)
        return
    mib = 1 << 20
    print(f"{'engine':6} {'payload':>8} {'sent':>8} {'receiver RSS':>13} {'sender RSS':>11} {'isends took':>11}  "
          "sender's transport")
    for nbytes in [int(x) for x in opts.nbytes.split(",")]:
        out = launch_json(os.path.abspath(__file__), 2, opts.engine, "--worker", "--nbytes", str(nbytes),
                          "--count", str(opts.count), "--stall", str(opts.stall), timeout=900)
        sender, receiver = out["grown"]
        print(f"{opts.engine:6} {nbytes:>6} B {opts.count:8} {receiver / mib:+10.1f} MiB {sender / mib:+8.1f} MiB "
              f"{out['posted_s']:9.2f} s  {out['held']}")
    print("(RSS growth over the stall; every message then arrived intact and in order)")


if __name__ == "__main__":
    main()
