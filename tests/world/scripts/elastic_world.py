"""A lockstep loop in an elastic world (popmesh launch --nnodes MIN:MAX): each step every rank all-reduces
a one (the sum is the world's size) and admits whoever waits to join; the step count is shared with the
newcomers and after every re-form. The loop ends after ``STEPS`` steps once the world has had ``GROWN``
ranks (and, with a victim, once the world shrank); from then on, launcher rank ``VICTIM`` (-1: none)
kills itself at step ``AT`` or later; an optional 6th argument is the world's ``fingerprint``. Each rank
prints what it saw: its launcher rank, the sizes with their sums, its final rank, size and roster."""

import os
import signal
import sys
import time

import numpy as np

import popmesh

steps, pause, victim, at, grown = (float(a) if i == 1 else int(a) for i, a in enumerate(sys.argv[1:6]))
world = popmesh.init(fingerprint=sys.argv[6] if len(sys.argv) > 6 else None)  # POPMESH_TIMEOUT: the tests set it
slot = world.roster[world.rank]


def shared(step: int) -> int:
    return int(popmesh.broadcast(np.array([step], dtype=np.int64), src=0)[0])


step = shared(0) if world.rank in world.newcomers else 0
largest, sizes = 0, []
while step < steps or largest < grown or (victim >= 0 and world.size == largest):
    if slot == victim and step >= at and largest >= grown:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        total = int(popmesh.all_reduce(np.ones(1, dtype=np.int64))[0])
    except popmesh.PeerFailure:
        world.reform()
        step = shared(step)
        continue
    sizes.append((world.size, total))
    largest = max(largest, world.size)  # the sizes it stepped at
    step += 1
    if world.admit():
        step = shared(step)
    time.sleep(pause)
popmesh.barrier()
print(f"SLOT {slot} RANK {world.rank} SIZE {world.size} SEEN {sorted(set(sizes))} ROSTER {list(world.roster)} "
      f"GENERATION {world.generation}", flush=True)
