"""Synchronous population policies (AverageAll, SelectiveAveraging) on real worlds: 1 rank, torch/gloo
at 2, 3 and 4 ranks and MPI at 3 ranks, one pytest item per check.
The training files (population, buffers, compat) share one world per engine and size."""


from workers import population_sync_worker as worker
from worldtests import world_tests

world_run, test_check, test_world_exits_cleanly = world_tests(
    worker, [("local", 1), ("torch", 2), ("torch", 3), ("torch", 4), ("mpi", 3)], timeout=240, suite="training"
)
