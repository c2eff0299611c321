"""Rank 0 enters an all_reduce that the last rank never joins; the timeout must end the world. A rank
whose collective timed out finalizes at once (gloo still runs the failed collective: destroying the
process group first would wait for it) and says how long that took."""

import os
import sys
import time
from pathlib import Path

import numpy as np

import popmesh
from popmesh.core.errors import CommTimeout

world = popmesh.init()
piddir = os.environ.get("POPMESH_TEST_PIDDIR")
if piddir:
    Path(piddir, f"{world.rank}.pid").write_text(str(os.getpid()))
if world.rank == world.size - 1:
    time.sleep(600)  # alive, but never calls the collective
    sys.exit(0)
try:
    popmesh.all_reduce(np.ones(4), timeout=2)
except CommTimeout:
    start = time.monotonic()
    world.finalize()
    print(f"finalized in {time.monotonic() - start:.2f} s", flush=True)
    raise
