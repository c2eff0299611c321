"""MPI flow control on a real world (popmesh.engines.mpi.flow). argv[1]: frames in the flood.

1. Rank 0 isends a flood of 1 KiB messages to rank 1, which receives nothing on that tag for a few
   seconds but polls a receive on another (MPI progresses there all along, so a fabric that buffers
   eager messages at the receiver would take them all): at most a window of frames is in flight,
   the rest waits at rank 0, rank 1's RSS stays bounded, a blocking send past the window and the
   wait of an isend past it time out naming rank 1, and the heartbeat takes neither rank for dead.
2. Rank 1 receives: every message, the timed-out one last, arrives intact and in order.
3. Every rank isends more than a window to its ring successor, meets the others in a barrier, and
   only then receives from its predecessor: the frames waiting behind the window are posted by the
   receives themselves.
"""

import os
import sys
import time

import numpy as np
from scriptlib import resident_bytes

import popmesh
from popmesh.comm import messages as m
from popmesh.core.errors import CommTimeout
from popmesh.engines.mpi.flow import WINDOW_FRAMES

world = popmesh.init()
rank, size = world.rank, world.size
p2p = world.engine.p2p()
count = int(sys.argv[1])
stall = float(os.environ.get("FLOOD_STALL_S", "4"))


def message(i: int) -> np.ndarray:
    return np.full(256, i, dtype=np.int32)  # 1 KiB


if rank == 0:
    handles = [m.isend(message(i), 1, tag=7) for i in range(count)]
    mem = p2p.memory()
    assert mem["in_flight_frames"] <= WINDOW_FRAMES and mem["waiting_frames"] >= count - WINDOW_FRAMES, mem
    started = time.monotonic()
    try:
        m.send(message(count), 1, tag=7, timeout=2)
        raise AssertionError(f"a send past the window returned after {time.monotonic() - started:.1f} s")
    except CommTimeout as e:
        assert e.missing == (1,) and "rank 1 has not received" in str(e), (e.missing, str(e))
        print(f"rank 0 send past the window timed out naming rank 1 OK: {str(e)[:160]}")
    try:
        handles[-1].wait(0.5)
        raise AssertionError("an isend past the window completed while its receiver received nothing")
    except CommTimeout as e:
        assert e.missing == (1,) and "rank 1 has not received" in str(e), (e.missing, str(e))
    print(f"rank 0 holds while rank 1 does not receive: {p2p.memory()}")
elif rank == 1:
    before = resident_bytes()
    other, until = m.irecv(0, tag=8), time.monotonic() + stall
    while time.monotonic() < until:  # busy elsewhere: MPI progresses here all along
        other.done()
        time.sleep(0.001)
    del other
    grown = resident_bytes() - before
    print(f"rank 1 RSS grew {grown / 2**20:.1f} MiB while {count} messages of 1 KiB were sent to it")
    assert grown < 48 << 20, f"grew {grown} bytes while {count} KiB were sent"
    assert world.failure() is None, f"a rank was taken for dead: {world.failure()}"
popmesh.barrier()
if rank == 1:
    for i in range(count + 1):
        src, got = m.recv(0, tag=7, timeout=60)
        assert src == 0 and got.shape == (256,) and int(got[0]) == i and int(got[-1]) == i, (i, got[:2])
    print(f"rank 1 received all {count + 1} messages intact and in order OK")
elif rank == 0:
    for h in handles:
        h.wait(60)
    assert p2p.memory()["waiting_frames"] == 0, p2p.memory()
popmesh.barrier()

right, left = (rank + 1) % size, (rank - 1) % size
n = WINDOW_FRAMES + 300
ring = [m.isend(np.full(8, 1000 * rank + i), right, tag=9) for i in range(n)]
mem = p2p.memory()  # nobody receives before the barrier
assert mem["in_flight_frames"] <= WINDOW_FRAMES and mem["waiting_frames"] >= 300, mem
popmesh.barrier()  # a collective while frames wait: it posts what it can, and nothing is stuck
for i in range(n):
    src, got = m.recv(left, tag=9, timeout=60)
    assert src == left and int(got[0]) == 1000 * left + i, (i, got[:2])
for h in ring:
    h.wait(60)
print(f"rank {rank} ring past the window OK")
popmesh.barrier()
print(f"rank {rank} window OK")
world.finalize()
