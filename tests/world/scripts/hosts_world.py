"""A world spread over hosts: every rank reports its host and the all-reduce of rank+1."""

import socket
import sys
import time

import numpy as np

import popmesh

world = popmesh.init()
total = popmesh.all_reduce(np.array([world.rank + 1.0]), timeout=60)
print(f"HOST rank={world.rank} size={world.size} host={socket.gethostname()} sum={float(total[0]):g}", flush=True)
if world.size % 2 == 0:  # messages around the ring, across the hosts: 4 B, one envelope, a segment of 336 KB
    right, left = (world.rank + 1) % world.size, (world.rank - 1) % world.size
    for numel in (1, 2000, 84_000):
        mine = np.arange(numel, dtype=np.float32) + world.rank
        for turn in (0, 1):  # even ranks send first, odd ranks receive first: blocking sends cannot deadlock
            if turn == world.rank % 2:
                popmesh.send(mine, right, tag=3, timeout=60)
            else:
                src, got = popmesh.recv(left, tag=3, timeout=60)
                assert src == left and np.array_equal(got, np.arange(numel, dtype=np.float32) + left), numel
    print(f"RING rank={world.rank} ok", flush=True)
if len(sys.argv) > 1 and sys.argv[1] == "hold":  # the first half waits in a collective for the second, which sleeps
    print(f"HOLDING rank={world.rank}", flush=True)
    if world.rank >= world.size // 2:
        time.sleep(120)
    popmesh.barrier(timeout=120)
world.finalize()
