"""The last rank freezes itself (SIGSTOP) or dies (SIGKILL) while the others wait on it in a collective
or a receive with a 300 s timeout: the heartbeat must end their waits with a PeerFailure naming it
within the heartbeat timeout. argv (or POPMESH_TEST_FROZEN): freeze|die collective|group|recv
(group: a collective over a subgroup, which has connections of its own)."""

import os
import signal
import sys
import time

import numpy as np

import popmesh
from popmesh.comm import messages as m
from popmesh.core.errors import PeerFailure

how, where = sys.argv[1:3] if len(sys.argv) > 2 else os.environ["POPMESH_TEST_FROZEN"].split()
world = popmesh.init()
rank, last = world.rank, world.size - 1
group = world.new_group(range(world.size)) if where == "group" else None
pids = [int(p) for p in popmesh.all_gather(np.array(os.getpid()), timeout=60)]
if rank == last:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGSTOP if how == "freeze" else signal.SIGKILL)
    time.sleep(3600)
start = time.monotonic()
try:
    if where in ("collective", "group"):
        popmesh.all_reduce(np.ones(4), group=group, timeout=300)
    else:
        m.recv(last, tag=3, timeout=300)
except PeerFailure as e:
    print(f"rank {rank} DETECTED ranks={list(e.ranks)} after {time.monotonic() - start:.1f} s: {e}", flush=True)
else:
    print(f"rank {rank} NOT DETECTED: the call returned", flush=True)
sys.stdout.flush()
time.sleep(1)  # under mpiexec, a rank that ends takes the others down: let them report first
if rank == 0 and how == "freeze":
    os.kill(pids[last], signal.SIGKILL)  # the frozen rank would never end by itself
os._exit(0)
