"""A world spread over hosts: every rank reports its host and the all-reduce of rank+1."""

import socket
import sys
import time

import numpy as np

import popmesh

world = popmesh.init()
total = popmesh.all_reduce(np.array([world.rank + 1.0]), timeout=60)
print(f"HOST rank={world.rank} size={world.size} host={socket.gethostname()} sum={float(total[0]):g}", flush=True)
if len(sys.argv) > 1 and sys.argv[1] == "hold":  # the first half waits in a collective for the second, which sleeps
    print(f"HOLDING rank={world.rank}", flush=True)
    if world.rank >= world.size // 2:
        time.sleep(120)
    popmesh.barrier(timeout=120)
world.finalize()
