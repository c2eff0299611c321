"""A ring exchange as the very first point-to-point traffic of a fresh world, waiting on the send
first: ``hs = isend(x, right); hr = irecv(left); hs.wait(); hr.wait()``. Correct under MPI's progress
rule at every size; the size (bytes) comes from argv[1]. Then messages on 2,000 tags: threads per
rank stay few, and none outlives finalize."""

import os
import sys
import threading

import numpy as np

import popmesh
from popmesh.comm import messages as m

world = popmesh.init()
rank, size = world.rank, world.size
nbytes = int(sys.argv[1])
right, left = (rank + 1) % size, (rank - 1) % size
hs = m.isend(np.full(nbytes // 8, rank + 1, dtype=np.int64), right, tag=5)
hr = m.irecv(left, tag=5)
hs.wait(15)
src, got = hr.wait(15)
assert src == left and got.size == nbytes // 8 and int(got[0]) == left + 1 and int(got[-1]) == left + 1
print(f"rank {rank} ring OK")
for tag in range(100, 2100):  # many channels: threads per rank stay a small constant
    m.isend(b"x", right, tag=tag)
for tag in range(100, 2100):
    assert m.recv(left, tag=tag, timeout=30) == (left, b"x")
threads = [t.name for t in threading.enumerate() if t.name.startswith("popmesh-")]
tasks = len(os.listdir("/proc/self/task"))
assert len(threads) <= 12 and tasks <= 48, (len(threads), tasks, threads[:20])
world.finalize()
left_over = [t.name for t in threading.enumerate() if t.name.startswith("popmesh-")]
assert not left_over, f"threads outlive finalize: {left_over}"
print(f"rank {rank} threads OK ({len(threads)} popmesh threads, {tasks} in all)")
