"""OneSidedAveraging and the MPI snapshot windows under mpiexec at 1 and 3 ranks,
one world per size, one pytest item per check."""


from workers import population_one_sided_worker as worker
from worldtests import world_tests

world_run, test_check, test_world_exits_cleanly = world_tests(
    worker, [("mpi", 1), ("mpi", 3)], timeout=240
)
