"""A script that knows nothing of tracing, run by `popmesh launch --trace DIR` (tests/world/test_trace.py).

Rank r contributes r+1 to an all_reduce, passes a message around the ring, and times a "work" section
in which rank 1 sleeps longest (the straggler). ``die`` as the first argument: rank 1 ends hard
(os._exit, no finalize) after the traced work, so only the other ranks can leave their files."""

import os
import sys
import time

import numpy as np

import popmesh
from popmesh.observe.reports import Timer

world = popmesh.init()
rank, size = world.rank, world.size
timer = Timer()
for i in range(3):
    with timer.section("work"):
        time.sleep(0.05 if rank == 1 else 0.01)
    total = popmesh.all_reduce(np.array([rank + 1.0]))
    assert total[0] == size * (size + 1) / 2, total
    popmesh.send(np.full(3, rank, np.int64), (rank + 1) % size, tag=i)
    src = (rank - 1) % size
    sender, got = popmesh.recv(src, tag=i)
    assert sender == src and got.tolist() == [src] * 3
if len(sys.argv) > 1 and sys.argv[1] == "die" and rank == 1:
    os._exit(3)
popmesh.barrier()
print(f"rank {rank} done", flush=True)
