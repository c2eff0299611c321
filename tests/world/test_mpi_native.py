"""The MPI transport's C path on a real MPI world (shared with the other communication files: suite
"comm"). ``POPMESH_MPI_NATIVE=1`` makes the suite's MPI worlds require it, so a checkout whose C path
did not build fails here instead of quietly measuring the Python path."""

from workers import mpi_native_worker as worker
from worldtests import world_tests

world_run, test_check, test_world_exits_cleanly = world_tests(
    worker, [("mpi", 2)], timeout=240, suite="comm",
    env_for=lambda engine, size: {"POPMESH_MPI_NATIVE": "1"} if engine == "mpi" else {},
)
