"""A plain mpi4py script (no popmesh import): rank 1 raises, exits non-zero or is killed while the
others wait in a barrier. argv[1]: raise|exit|kill."""

import os
import signal
import sys
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD
if comm.Get_rank() == 1:
    time.sleep(0.3)
    how = sys.argv[1]
    if how == "raise":
        raise ValueError("rank 1 gives up")
    if how == "exit":
        sys.exit(3)
    os.kill(os.getpid(), signal.SIGKILL)
comm.Barrier()
