"""Every collective on real worlds: local (1 rank), torch/gloo and MPI at 1, 2 and 3 ranks (worlds shared
with the other communication files: suite "comm")."""


from workers import collectives_worker as worker
from worldtests import world_tests

world_run, test_check, test_world_exits_cleanly = world_tests(
    worker,
    [("local", 1), ("torch", 2), ("torch", 3), ("mpi", 1), ("mpi", 2), ("mpi", 3)],
    timeout=240,
    env_for=lambda engine, size: {"EXPECT_SIZE": str(size)},
    suite="comm",
)
