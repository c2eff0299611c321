"""SampleSharing on real worlds (torch/gloo at 2 and 3 ranks, MPI at 3), the last rank five times slower.
Its checks run in the training suite's worlds."""

from workers import sharing_worker as worker
from worldtests import world_tests

world_run, test_check, test_world_exits_cleanly = world_tests(
    worker, [("torch", 2), ("torch", 3), ("mpi", 3)], timeout=120, suite="training"
)
