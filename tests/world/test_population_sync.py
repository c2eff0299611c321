"""Synchronous population policies (AverageAll, SelectiveAveraging) on real worlds: 1 rank, torch/gloo
at 4 ranks and MPI at 3 ranks, one world per engine and size, one pytest item per check."""


from workers import population_sync_worker as worker
from worldtests import world_tests

world_run, test_check, test_world_exits_cleanly = world_tests(
    worker, [("local", 1), ("torch", 4), ("mpi", 3)], timeout=240
)
