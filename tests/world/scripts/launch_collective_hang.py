"""Rank 0 enters an all_reduce that the last rank never joins; the timeout must end the world."""

import os
import sys
import time
from pathlib import Path

import numpy as np

import popmesh

world = popmesh.init()
piddir = os.environ.get("POPMESH_TEST_PIDDIR")
if piddir:
    Path(piddir, f"{world.rank}.pid").write_text(str(os.getpid()))
if world.rank == world.size - 1:
    time.sleep(600)  # alive, but never calls the collective
    sys.exit(0)
popmesh.all_reduce(np.ones(4), timeout=2)
