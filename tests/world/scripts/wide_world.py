"""A wide world on one box: a collective, a ring of messages, and threads per rank that stay a
small constant whatever the world size (no thread per peer, none per tag)."""

import os
import threading

import numpy as np

import popmesh
from popmesh.comm import messages as m

world = popmesh.init()
rank, size = world.rank, world.size
total = popmesh.all_reduce(np.array([rank + 1.0]), timeout=240)
assert float(total[0]) == size * (size + 1) / 2, total
send = m.isend(np.full(1000, rank), (rank + 1) % size, tag=3)
src, got = m.recv((rank - 1) % size, tag=3, timeout=240)
send.wait(240)
assert src == (rank - 1) % size and int(got[0]) == src
ours = len([t for t in threading.enumerate() if t.name.startswith("popmesh-")])
tasks = len(os.listdir("/proc/self/task"))
rows = popmesh.all_gather(np.array([ours, tasks]), timeout=240)
if rank == 0:
    print(f"WIDE size={size} popmesh threads <= {int(rows[:, 0].max())}, all threads <= {int(rows[:, 1].max())}",
          flush=True)
assert ours <= 8 and tasks <= 16, (ours, tasks)
world.finalize()
