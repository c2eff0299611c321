"""MPI worker: every rank contributes rank+1 to an allreduce; with argv[1] == "raise" rank 1 raises."""

import os
import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
total = comm.allreduce(comm.rank + 1)
print(f"mpi rank {comm.rank} of {comm.size} engine={os.environ.get('POPMESH_ENGINE')} sum={total}")
if len(sys.argv) > 1 and sys.argv[1] == "raise" and comm.rank == 1:
    raise RuntimeError("deliberate MPI failure in rank 1")
comm.Barrier()
