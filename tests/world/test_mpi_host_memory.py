"""The MPI engine's host-memory rule on real MPI worlds of 1, 2 and 3 ranks: CPU tensors at every
collective entry point, and tensors off the host refused before MPI sees them (collectives and
one-sided windows). Shares the "comm" suite's worlds."""


from workers import mpi_host_memory_worker as worker
from worldtests import world_tests

world_run, test_check, test_world_exits_cleanly = world_tests(
    worker, [("mpi", 1), ("mpi", 2), ("mpi", 3)], timeout=180, suite="comm"
)
