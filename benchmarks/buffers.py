"""The replay-buffer service: one ``add`` round trip (batch to the manager, score back) at several
world sizes, against a plain ``popmesh.send``/``recv`` echo of the same bytes on the same ranks.

One manager serves every other rank (``assign_roles(num_buffers=1)``): the manager's load grows
with the agents it serves. Each agent first times an echo (the manager answers a 16-byte reply to
the same batch dict: the bare message cost), then ``ReplayBufferClient(mode="sync").add`` with the
unscored default (FIFO store and baseline: the service's own cost). Rows of 64 states x 16 float32
(4 KiB) plus log-rewards, as a small GFlowNet batch.

    python benchmarks/buffers.py [--nproc 2,4,8] [--engines torch,mpi] [--reps 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import launch_json, write_result

ECHO_TAG = 900


def worker(reps: int) -> None:
    import popmesh
    from popmesh.buffers import ReplayBufferClient, ReplayBufferManager
    from popmesh.comm import messages as m

    world = popmesh.init()
    ctx = popmesh.assign_roles(world, num_buffers=1, num_agent_groups=1)
    batch = {"states": np.ones((64, 16), np.float32), "log_rewards": np.zeros(64, np.float32)}
    row = np.zeros(2)
    if ctx.is_buffer_rank():
        agents = sorted(ctx.assigned_training_ranks)
        for _ in range(reps * len(agents)):  # the echo: one reply per request, whoever sent it
            src, _ = m.recv(agents, tag=ECHO_TAG, timeout=600)
            m.send(np.zeros(2), src, tag=ECHO_TAG + 1, timeout=600)
        ReplayBufferManager.from_context(ctx, capacity=10_000).run()
    else:
        echo = []
        for _ in range(reps):
            start = time.perf_counter()
            m.send(batch, ctx.assigned_buffer, tag=ECHO_TAG, timeout=600)
            m.recv(ctx.assigned_buffer, tag=ECHO_TAG + 1, timeout=600)
            echo.append(time.perf_counter() - start)
        client = ReplayBufferClient.from_context(ctx, mode="sync")
        adds = []
        for _ in range(reps):
            start = time.perf_counter()
            client.add(batch)
            adds.append(time.perf_counter() - start)
        client.drain()
        row = np.array([statistics.median(echo[reps // 10:]), statistics.median(adds[reps // 10:])])
    rows = popmesh.all_gather(row, timeout=600)
    if world.rank == 0:
        write_result({"rows": rows.tolist(), "manager": sorted(ctx.buffer_rank_set)})
    world.finalize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", default="2,4,8")
    parser.add_argument("--engines", default="torch,mpi")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--worker", action="store_true")
    opts = parser.parse_args()
    if opts.worker:
        worker(opts.reps)
        return
    print(f"{'engine':6} {'ranks':>5} {'agents':>6} {'echo':>10} {'add':>10} {'add / echo':>10}")
    for engine in opts.engines.split(","):
        for n in [int(x) for x in opts.nproc.split(",")]:
            result = launch_json(os.path.abspath(__file__), n, engine, "--worker", "--reps", str(opts.reps))
            rows = [r for i, r in enumerate(result["rows"]) if i not in result["manager"]]
            echo = statistics.median(r[0] for r in rows)
            add = statistics.median(r[1] for r in rows)
            print(f"{engine:6} {n:5} {len(rows):6} {echo * 1e6:7.0f} us {add * 1e6:7.0f} us {add / echo:9.2f}x",
                  flush=True)
    print("(median over agents of each agent's median round trip; one manager serves every agent; "
          "more ranks than cores measure oversubscription too)")


if __name__ == "__main__":
    main()
