"""OneSidedAveraging and the MPI snapshot windows under mpiexec at 1, 2 and 3 ranks (the MPI engine only),
one pytest item per check. The training files (population, buffers, compat) share one world per engine and size."""


from workers import population_one_sided_worker as worker
from worldtests import world_tests

world_run, test_check, test_world_exits_cleanly = world_tests(
    worker, [("mpi", 1), ("mpi", 2), ("mpi", 3)], timeout=240, suite="training"
)
