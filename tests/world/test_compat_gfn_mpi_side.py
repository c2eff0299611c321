"""popmesh.compat.gfn on a torch world that mpiexec started (torchgfn's ``--dist_backend gloo`` under
mpiexec): the context's ``dc_mpi4py`` holds mpi4py communicators with the torch groups' members, the
facades take them back, ``AverageAllPolicympi4py`` is bit-identical to torchgfn's arithmetic done by
hand, and the one-sided policies decide from the same random draws as torchgfn. Worlds of 1, 2 and 3
ranks, one world per size (tests/world/workers/compat_gfn_mpi_side_worker.py); outside an MPI launch
the context and the policies say how to launch instead (tests/world/test_compat_gfn.py,
test_compat_spawn_policy.py)."""

import pytest

from workers import compat_gfn_mpi_side_worker as worker
from worldtests import world_tests

pytest.importorskip("torch")
pytest.importorskip("mpi4py")
pytestmark = [pytest.mark.world, pytest.mark.mpi]

world_run, test_on_a_world, test_world_exits_cleanly = world_tests(
    worker, [("mpi", 1), ("mpi", 2), ("mpi", 3)], timeout=180,
)
